"""ShardService in-process: no client can stop, confuse or exhaust a shard.

Parked pulls of a wave that detaches or leaves, waves named from another connection, the wave
limit, what a dropped wave leaves behind, a restored shard's re-joins, admin by CURVE key, and a
shutdown that always cleans up."""

import time

import pytest
import torch
from helpers import ServiceWave, reply_of, service_for

from wavelet.common.protocol import Header, Op, encode
from wavelet.common.shm import SHM_DIR
from wavelet.ps.owners import Peer
from wavelet.ps.service import ShardService


def _codes(messages) -> list[str]:
    return [reply_of(m).body.get("code", "reply") for m in messages]


@pytest.mark.parametrize("then", ["attach_tcp", "leave"])
def test_a_parked_shared_memory_pull_of_a_wave_that_drops_its_segments(tmp_path, then):
    service = service_for(tmp_path, expect_waves=2)  # the start barrier parks the first pull
    try:
        wave = ServiceWave(service)
        wave.join()
        assert wave.request(Op.ATTACH).body["transport"] == "shm"
        assert wave.send(Op.PULL, clock=0, body={"shm": True}) == []  # parked
        if then == "attach_tcp":
            out = wave.send(Op.ATTACH, body={"transport": "tcp"})
            assert _codes(out) == ["not_attached", "reply"]  # the parked pull, then the attach
        else:
            out = wave.send(Op.LEAVE)
            assert _codes(out) == ["not_registered", "reply"]
        assert len(service.parked) == 0
        # the barrier opens: nothing is left to release into segments that are gone
        other = ServiceWave(service, worker="w1")
        assert other.join().op == "reply"
        assert service.tick() == []
        assert other.request(Op.PULL, clock=0).op == "reply"
    finally:
        service.close()


def test_a_failure_while_releasing_parked_pulls_is_answered_not_raised(tmp_path, monkeypatch):
    service = service_for(tmp_path, expect_waves=2)
    try:
        wave = ServiceWave(service)
        wave.join()
        assert wave.send(Op.PULL, clock=0) == []  # parked at the barrier

        def broken(*args, **kwargs):
            raise RuntimeError("a bug while serving weights")

        monkeypatch.setattr(service, "_weights", broken)
        other = ServiceWave(service, worker="w1")
        out = other.send(Op.REGISTER, clock=0)  # opens the barrier: the release fails
        assert sorted(_codes(out)) == ["internal", "reply"]
        assert len(service.parked) == 0
        monkeypatch.undo()
        assert wave.request(Op.PULL, clock=0).op == "reply"  # and the shard goes on
    finally:
        service.close()


def test_a_wave_named_from_another_connection_changes_nothing(tmp_path):
    service = service_for(tmp_path)
    try:
        wave = ServiceWave(service)
        wave.join()
        assert wave.request(Op.ATTACH).body["transport"] == "shm"
        before = [v.clone() for v in service.shard.values()]
        impostor = ServiceWave(service, peer=b"another connection")  # names w0/0 too
        grads = [torch.ones(c.numel) for c in wave.chunks]
        for op, kwargs in [
            (Op.ATTACH, {"body": {"transport": "tcp"}}),
            (Op.ATTACH, {}),
            (Op.LEAVE, {}),
            (Op.PUSH, {"clock": 0, "read_version": 0, "keys": wave.keys, "tensors": grads}),
            (Op.PULL, {"clock": 0}),
            (Op.REGISTER, {"clock": 0}),
        ]:
            tensors = kwargs.pop("tensors", ())
            h = impostor.request(op, tensors, **kwargs)
            assert h.op == "error" and h.body["code"] == "wave_in_use", (op, h.body)
        assert all(torch.equal(a, b) for a, b in zip(before, service.shard.values(), strict=True))
        assert service.datapath.segments.get(("w0", 0)) is not None  # its segments are untouched
        assert wave.push(0, 0).op == "reply"  # the owner goes on
        # once the owner's connection closes, a new connection (a restarted worker) re-joins
        service.connection_closed(wave.peer)
        assert impostor.push(1, 1).body["code"] == "not_registered"
        assert impostor.request(Op.REGISTER, clock=1, body={"exact": True}).op == "reply"
        assert impostor.push(1, 1).op == "reply"
        assert wave.push(2, 2).body["code"] == "wave_in_use"
    finally:
        service.close()


def test_heartbeats_keep_alive_only_waves_whose_connection_is_open(tmp_path):
    service = service_for(tmp_path)
    try:
        wave = ServiceWave(service)
        wave.join()
        service.connection_closed(wave.peer)
        seen = service.clocks.last_seen[("w0", 0)]
        time.sleep(0.01)
        beat = ServiceWave(service, peer=b"heartbeat")
        assert beat.request(Op.HEARTBEAT, body={"waves": [0]}).op == "reply"
        assert service.clocks.last_seen[("w0", 0)] == seen
    finally:
        service.close()


def test_the_number_of_waves_is_bounded_and_a_wave_that_left_makes_room(tmp_path):
    service = service_for(tmp_path, max_waves=2)
    try:
        a, b = ServiceWave(service, "a"), ServiceWave(service, "b")
        a.join()
        b.join()
        h = ServiceWave(service, "c").request(Op.REGISTER, clock=0)
        assert h.op == "error" and h.body["code"] == "limit" and "max_waves" in h.body["message"]
        assert ("c", 0) not in service.clocks.clocks
        assert b.request(Op.LEAVE).op == "reply"
        assert ServiceWave(service, "c").request(Op.REGISTER, clock=0).op == "reply"
        assert a.request(Op.REGISTER, clock=0).op == "reply"  # a known wave re-registers
    finally:
        service.close()


def test_the_default_wave_limit_follows_the_expected_waves(tmp_path):
    assert service_for(tmp_path / "a", expect_waves=20, shm=False).members.max_waves == 40
    assert service_for(tmp_path / "b", shm=False).members.max_waves == 16


def test_a_wave_dropped_for_silence_leaves_nothing_behind(tmp_path):
    service = service_for(tmp_path, job={"stale_policy": "dc-asgd", "wave_timeout_s": 1.0})
    try:
        wave = ServiceWave(service)
        wave.join()
        assert wave.request(Op.ATTACH).body["transport"] == "shm"
        assert wave.request(Op.PULL, clock=0).op == "reply"
        wave.push(0, 0)
        wave_id = ("w0", 0)
        assert (
            wave_id in service.updates.policy.read
            and service.datapath.segments.get(wave_id) is not None
        )
        prefix = service.datapath.segments.prefix
        files = len(list(SHM_DIR.glob(prefix + "*")))
        assert files == 2 + 3  # its two segments, the shard's three weight slots
        service.tick(now=time.monotonic() + 5)
        assert wave_id not in service.clocks.live
        assert wave_id not in service.updates.policy.read  # its DC-ASGD weight copy
        assert service.datapath.segments.get(wave_id) is None
        assert len(list(SHM_DIR.glob(prefix + "*"))) == 3  # the slots alone: shard memory
        assert not service.datapath.slots.readers  # the slot it read is free
        assert wave_id not in service.shard.wave_buffers
    finally:
        service.close()


def test_a_shard_that_moved_answers_without_alarm_and_drops_no_wave_for_silence(tmp_path, caplog):
    """Its waves talk to its standby now: a request is told where it went, and their silence
    here is no news to log or act on."""
    service = service_for(tmp_path, shm=False)
    try:
        wave = ServiceWave(service)
        wave.join()
        service.moved_to = "tcp://127.0.0.1:1"
        with caplog.at_level("WARNING"):
            assert wave.request(Op.PULL, clock=0).body["code"] == "moved"
            service.tick(now=time.monotonic() + 1e6)
        assert ("w0", 0) in service.clocks.live
        assert not caplog.records, caplog.text
    finally:
        service.close()


def test_a_dropped_wave_no_longer_counts_in_the_served_buffers(tmp_path):
    service = service_for(tmp_path, shm=False)
    try:
        a, b = ServiceWave(service, "a"), ServiceWave(service, "b")
        a.join()
        b.join()
        shard = service.shard
        # two waves upload different values for a buffer-like key: the served value is the mean
        key = shard.specs[0].key
        shard.wave_buffers[("a", 0)] = {key: torch.zeros(shard.specs[0].desc.numel)}
        shard.wave_buffers[("b", 0)] = {key: torch.full((shard.specs[0].desc.numel,), 4.0)}
        assert float(shard._buffer_value(shard.specs[0]).mean()) == 2.0
        service.tick(now=time.monotonic() + 1e6)  # both silent: dropped, b last
        assert shard.wave_buffers == {}
        assert float(shard.buffers[key].mean()) in (0.0, 4.0)  # the last values known stay
    finally:
        service.close()


def test_a_restored_shard_makes_every_wave_register_again(tmp_path):
    service = service_for(tmp_path, checkpoint_every=5, shm=False)
    wave = ServiceWave(service)
    wave.join()
    for clock in range(7):
        wave.push(clock, clock)
    service.checkpoints.push_log.close()  # killed after version 7, its checkpoint holds 5
    restarted = service_for(tmp_path, checkpoint_every=5, shm=False)
    try:
        again = ServiceWave(restarted, peer=wave.peer)  # whatever the connection
        h = again.push(7, 7)
        # not "stale clock": the client re-joins on this answer, however slow the restart was
        assert h.op == "error" and h.body["code"] == "not_registered", h.body
        assert restarted.shard.version == 5
        joined = again.request(Op.REGISTER, clock=8, body={"exact": True})
        assert joined.op == "reply" and joined.body["clock"] == 8
        assert again.push(8, 5).op == "reply"
    finally:
        restarted.close()


def test_with_an_admin_key_only_that_client_key_may_checkpoint_or_stop(tmp_path):
    config = service_for(tmp_path, shm=False).config
    service = ShardService(config, admin_token="secret", admin_key="ADMINKEY")
    try:
        wave = ServiceWave(service)
        wave.join()
        for op in (Op.SHUTDOWN, Op.CHECKPOINT):
            h = wave.request(op, body={"token": "secret"})  # a token any store client can read
            assert h.op == "error" and h.body["code"] == "unauthorized"
        other_key = _request_as(service, Peer(b"x", key="OTHERKEY"), Op.SHUTDOWN)
        assert other_key.body["code"] == "unauthorized" and not service.stopping
        h = _request_as(service, Peer(b"admin", key="ADMINKEY"), Op.SHUTDOWN)
        assert h.op == "reply" and service.stopping
    finally:
        service.close()


def _request_as(service: ShardService, peer: Peer, op: Op) -> Header:
    (message,) = service.handle(peer, [bytes(f) for f in encode(Header(op=op))])
    return reply_of(message)


def test_a_failed_checkpoint_does_not_reset_its_age(tmp_path):
    service = service_for(tmp_path, checkpoint_every=1, shm=False)
    try:
        wave = ServiceWave(service)
        wave.join()
        ok_at = service.checkpoints.ok_at
        (tmp_path / "checkpoints").write_text("a file where the folder belongs")
        wave.push(0, 0)
        assert service.checkpoints.failures == 1
        assert service.checkpoints.ok_at == ok_at
    finally:
        (tmp_path / "checkpoints").unlink()
        service.close()


def test_shutdown_cleans_up_whatever_the_final_checkpoint_raises(tmp_path, monkeypatch):
    service = service_for(tmp_path, expect_waves=2)
    wave = ServiceWave(service)
    wave.join()
    assert wave.request(Op.ATTACH).body["transport"] == "shm"
    assert wave.send(Op.PULL, clock=0) == []  # parked

    def broken():
        raise RuntimeError("not an OSError")

    monkeypatch.setattr(service.checkpoints, "write", broken)
    out = service.close()
    assert _codes(out) == ["shutting_down"]
    assert not list(SHM_DIR.glob(service.datapath.segments.prefix + "*"))
    assert service.checkpoints.push_log._file.closed


def test_with_curve_a_wave_is_reclaimed_only_with_its_own_key(tmp_path):
    service = service_for(tmp_path, shm=False)
    try:
        wave = ServiceWave(service)
        wave.peer = Peer(b"first", key="KEY-A")
        wave.join()
        service.connection_closed(b"first")  # the worker restarts...
        wave.peer = Peer(b"stranger", key="KEY-B")  # ...but another client key claims the wave
        h = wave.request(Op.REGISTER, clock=0)
        assert h.op == "error" and h.body["code"] == "wave_in_use"
        wave.peer = Peer(b"second", key="KEY-A")  # the same client key, on a new connection
        assert wave.request(Op.REGISTER, clock=0).op == "reply"
    finally:
        service.close()
