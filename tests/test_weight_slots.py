"""Copy-free reads (ps/weight_slots.py): a local wave reads the shard's parameters in place; a
slot a wave reads is never written until its next request; with every slot held, the shard
falls back to copying into the wave's segment. In-process shard, real segments in /dev/shm."""

import torch
from helpers import ServiceWave, service_for

from wavelet.common.protocol import Op


def _pull(wave: ServiceWave, clock: int) -> dict:
    h = wave.request(Op.PULL, clock=clock, body={"shm": True})
    assert h.op == "reply", h.body
    return h.body


def _params(service) -> list[torch.Tensor]:
    return list(service.shard.params.values())


def _slot_values(service, slot: int) -> list[torch.Tensor]:
    return [v.clone() for v in service.datapath.slots.views[slot]]


def _joined(service, *names: str) -> list[ServiceWave]:
    waves = [ServiceWave(service, worker=n) for n in names]
    for w in waves:
        w.join()
        assert w.request(Op.ATTACH).body["transport"] == "shm"
    return waves


def test_one_reader_between_updates_reads_in_place_and_the_weights_never_move(tmp_path):
    service = service_for(tmp_path)
    try:
        (a,) = _joined(service, "a")
        slot = _pull(a, 0)["slot"]
        assert slot >= 0
        assert _params(service)[0].data_ptr() == service.datapath.slots.views[slot][0].data_ptr()
        for clock in range(5):
            a.push(clock, clock)  # its next request: done with the slot, written in place
            body = _pull(a, clock + 1)
            assert body["slot"] == slot and body["version"] == clock + 1
        assert service.datapath.slots.moves == 0
        # what the slot holds is what the shard serves
        for mine, served in zip(_slot_values(service, slot), service.shard.values(), strict=True):
            assert torch.equal(mine, served)
        assert service.datapath.read_counts() == {
            "into_wave": 0,
            "in_place": 6,
            "copied": 0,
            "slot_moves": 0,
        }
    finally:
        service.close()


def test_a_slot_a_wave_reads_is_not_written_until_its_next_request(tmp_path):
    service = service_for(tmp_path)
    try:
        a, b = _joined(service, "a", "b")
        read = _pull(a, 0)
        held = _slot_values(service, read["slot"])
        b.push(0, 0)  # an update while a reads: the weights move to a free slot first
        assert service.datapath.slots.moves == 1
        for before, now in zip(held, _slot_values(service, read["slot"]), strict=True):
            assert torch.equal(before, now)  # a's version, whole
        b_read = _pull(b, 1)
        assert b_read["slot"] != read["slot"] and b_read["version"] == 1
        served = service.shard.values()
        for mine, now in zip(_slot_values(service, b_read["slot"]), served, strict=True):
            assert torch.equal(mine, now)
        a.push(0, 0)  # a is done with its slot; b still holds its own
        assert read["slot"] not in service.datapath.slots.readers.values()
        assert b_read["slot"] in service.datapath.slots.readers.values()
    finally:
        service.close()


def test_with_every_slot_held_the_wave_gets_a_copy_of_one_whole_version(tmp_path):
    service = service_for(tmp_path)
    try:
        waves = _joined(service, "a", "b", "c", "d")
        held = []  # (slot, what it held when read)
        for clock, w in enumerate(waves[:3]):  # three readers of three versions
            if clock:
                waves[3].push(clock - 1, clock - 1)
            slot = _pull(w, 0)["slot"]
            held.append((slot, _slot_values(service, slot)))
        assert len({slot for slot, _ in held}) == 3
        waves[3].push(2, 2)  # every slot held: the update goes to private memory
        assert service.shard.detached == 1
        for slot, values in held:  # no reader's version touched
            for before, now in zip(values, _slot_values(service, slot), strict=True):
                assert torch.equal(before, now)
        body = _pull(waves[3], 3)
        assert body["slot"] == -1 and body["version"] == 3
        link = service.datapath.segments.get(("d", 0))
        for copied, served in zip(link.pull_views, service.shard.values(), strict=True):
            assert torch.equal(copied, served)
        waves[0].push(0, 0)  # a slot is free again: the next update moves back into it
        assert _pull(waves[3], 4)["slot"] >= 0
        assert service.datapath.read_counts()["copied"] == 1
    finally:
        service.close()
