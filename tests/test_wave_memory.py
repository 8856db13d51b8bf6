"""Pulled weights written straight into the wave's parameters (worker/wave_memory.py): the model's
parameters live in one anonymous shared segment that the shards on the host write into, so the
wave copies nothing; a bad offer costs only the copy; the model outlives its client."""

import os
from pathlib import Path

import pytest
import torch
from helpers import ServiceWave, client_for, service_for, tiny_model

from wavelet.common.protocol import Op
from wavelet.common.shm import Segment
from wavelet.worker.wave_memory import WaveMemory

JOB = ["--model", "mlp", "--dataset", "synthetic", "--staleness", "inf"]


def _span(segment: Segment) -> range:
    start = segment.tensor(0, 1, torch.uint8).data_ptr()
    return range(start, start + segment.size)


def _served(addresses) -> list[torch.Tensor]:
    """The shards' master weights, read as an observer over TCP into a model of its own."""
    model = tiny_model(hidden=512)
    c = client_for(model, addresses, worker="observer", transport="tcp")
    try:
        c.pull(0, observer=True, master=True)
    finally:
        c.close()
    return [t.detach().clone() for t in model.state_dict().values()]


def _step(model, client, pulled, clock, value):
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    return client.push_pull(clock, pulled.versions)


@pytest.mark.timeout(60)
def test_two_shards_write_the_pulled_weights_into_the_waves_own_parameters(shard_daemons):
    daemons = shard_daemons(JOB, count=2)
    model = tiny_model(hidden=512)
    c = client_for(model, daemons.addresses, transport="shm")
    try:
        c.register(0)
        memory = c.data.memory
        assert memory is not None and all(link.in_wave_memory for link in c.data.links)
        params = list(model.parameters())
        span = _span(memory.segment)
        assert all(p.data_ptr() in span for p in params)
        pulled = c.pull(0)
        for clock in range(3):
            pulled = _step(model, c, pulled, clock, 0.01 * (clock + 1))
        assert pulled.versions == [3, 3]
        # what the wave computes on is what the shards hold, and it still is its own memory
        served = _served(daemons.addresses)
        for mine, theirs in zip(model.state_dict().values(), served, strict=True):
            assert torch.equal(mine, theirs)
        assert all(p.data_ptr() in span for p in params)
        stats = c.stats()
        assert all(s["shm_reads"]["into_wave"] == 4 for s in stats), stats
        assert all(s["shm_reads"]["in_place"] == s["shm_reads"]["copied"] == 0 for s in stats)
    finally:
        c.close()
    # the model outlives its client: its parameters are private memory again, and whole
    assert not any(p.data_ptr() in span for p in model.parameters())
    for mine, theirs in zip(model.state_dict().values(), served, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.timeout(60)
def test_a_16_bit_wire_keeps_the_copy(shard_daemons):
    """A 16-bit wire rounds the weights the wave computes on: no wave memory for it."""
    daemons = shard_daemons([*JOB, "--wire-dtype", "bf16"], count=1)
    model = tiny_model()
    c = client_for(model, daemons.addresses, transport="shm", wire_dtype="bf16")
    try:
        c.register(0)
        c.pull(0)
        assert c.data.memory is None and c.data.transports == ["shm"]
    finally:
        c.close()


def _offer(wave: ServiceWave, memory: WaveMemory, **over) -> dict:
    return {"transport": "shm", **memory.offer(wave.chunks), **over}


def _pull(wave: ServiceWave, clock: int = 0) -> dict:
    h = wave.request(Op.PULL, clock=clock, body={"shm": True})
    assert h.op == "reply", h.body
    return h.body


def test_a_bad_offer_costs_the_wave_only_the_copy(tmp_path):
    service = service_for(tmp_path)
    try:
        wave = ServiceWave(service)
        wave.join()
        memory = WaveMemory.create(wave.tensors, [wave.chunks])
        try:
            n = len([c for c in wave.chunks if c.trainable])
            bad = [
                {"memory_nonce": "0" * 16},  # another segment (or another host)
                {"memory_fd": 987654},  # nothing there
                {"memory_pid": 2**22 + 7},  # no such process
                {"memory_size": memory.segment.size + 4096},
                {"memory_offsets": [0] * (n + 1)},  # not this shard's chunk count
                {"memory_offsets": [memory.segment.size] * n},  # past its end
            ]
            for over in bad:
                h = wave.request(Op.ATTACH, body=_offer(wave, memory, **over))
                assert h.op == "reply" and h.body["transport"] == "shm", (over, h.body)
                assert not h.body["wave_memory"] and h.body["memory_reason"], (over, h.body)
                body = _pull(wave)  # pulls go as before: from a weight slot
                assert not body["in_wave_memory"] and body["slot"] >= 0
            malformed = wave.request(Op.ATTACH, body={"transport": "shm", "memory_pid": -1})
            assert malformed.op == "error" and malformed.body["code"] == "malformed"
            # a good offer from this very process: the shard writes into it
            h = wave.request(Op.ATTACH, body=_offer(wave, memory))
            assert h.body["wave_memory"] and not h.body["memory_reason"], h.body
            for p in wave.model.parameters():
                p.data.zero_()
            assert _pull(wave)["in_wave_memory"]
            for c, value in zip(wave.chunks, service.shard.values(), strict=True):
                if c.trainable:
                    mine = wave.tensors[c.name].detach().view(-1)[c.offset : c.offset + c.numel]
                    assert torch.equal(mine, value)
        finally:
            memory.close()
    finally:
        service.close()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux only")
def test_the_memory_is_nowhere_in_the_shared_memory_folder_and_goes_with_its_process():
    memory = Segment.anonymous(1 << 20)
    try:
        assert memory.path.parent == Path(f"/proc/{os.getpid()}/fd")
        other = Segment.proc_open(os.getpid(), memory.fd, memory.size, memory.nonce)
        other.tensor(4096, 4, torch.float32).fill_(3.0)
        assert torch.equal(memory.tensor(4096, 4, torch.float32), torch.full((4,), 3.0))
        other.close()
        with pytest.raises(OSError, match="not the one offered"):
            Segment.proc_open(os.getpid(), memory.fd, memory.size, "f" * 16)
        with pytest.raises(OSError, match="bad offer"):  # a nonce short enough to guess
            Segment.proc_open(os.getpid(), memory.fd, memory.size, memory.nonce[:2])
    finally:
        memory.close()


def test_a_peer_cannot_name_any_other_file_to_be_written(tmp_path):
    """An offer names a pid and a descriptor: one that is an ordinary file (here one starting
    with the very nonce offered) is refused, whatever its size and first bytes."""
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"0123456789abcdef" + bytes(4096))
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(OSError, match="not a wave's memory"):
            Segment.proc_open(os.getpid(), fd, 4096 + 16, "0123456789abcdef")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"0123456789abcdef" + bytes(4096)
