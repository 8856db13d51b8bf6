"""ShardService in-process, without sockets: the rules of a shard, fast."""

import pytest
from helpers import ServiceWave as Wave
from helpers import service_for as _service

from wavelet.common.protocol import Op


def test_a_failing_periodic_checkpoint_is_counted_and_retried(tmp_path):
    service = _service(tmp_path, checkpoint_every=1)
    wave = Wave(service)
    wave.join()
    (tmp_path / "checkpoints").write_text("a file where the folder belongs")  # writes fail
    for clock in range(3):
        assert wave.push(clock, clock).op == "reply"
    assert service.checkpoints.failures == 3
    stats = wave.request(Op.STATS)
    assert stats.body["checkpoint_failures"] == 3 and stats.body["version"] == 3
    (tmp_path / "checkpoints").unlink()  # the disk is fine again: the next interval writes
    assert wave.push(3, 3).op == "reply"
    assert (tmp_path / "checkpoints" / "shard-0.pt").exists()
    assert service.checkpoints.failures == 3


def test_updates_lost_to_an_old_checkpoint_are_reported_on_resume(tmp_path):
    service = _service(tmp_path, checkpoint_every=5)
    wave = Wave(service)
    wave.join()
    for clock in range(7):  # versions 1..7; the checkpoint holds version 5
        wave.push(clock, clock)
    # a kill -9: no final checkpoint, and the kernel drops its lock
    service.checkpoints.push_log.close()
    service.datapath.segments.lock.release()
    restarted = _service(tmp_path, checkpoint_every=5)
    assert restarted.shard.version == 5 and restarted.checkpoints.lost_on_restore == 2
    h = Wave(restarted).join(resume=True)
    assert h.body["lost_updates"] == 2 and h.body["clock"] == 5
    assert Wave(restarted, worker="new").join().body["lost_updates"] == 0  # not a resume


@pytest.mark.parametrize("op", [Op.SHUTDOWN, Op.CHECKPOINT])
def test_admin_ops_without_the_token_change_nothing(tmp_path, op):
    service = _service(tmp_path)
    wave = Wave(service)
    wave.join()
    for body in ({}, {"token": "wrong"}):
        h = wave.request(op, body=body)
        assert h.op == "error" and h.body["code"] == "unauthorized"
    assert not service.stopping and not (tmp_path / "checkpoints").exists()
    assert wave.request(op, body={"token": "secret"}).op == "reply"


def test_bodies_are_typed_and_checked_in_one_place(tmp_path):
    service = _service(tmp_path)
    wave = Wave(service)
    wave.join()
    bad = [
        (Op.HEARTBEAT, {"waves": "all"}, "body.waves"),
        (Op.HEARTBEAT, {}, "needs body.waves"),
        (Op.PULL, {"observer": 1}, "body.observer"),
        (Op.REGISTER, {"resume": True, "extra": 1}, "unknown field"),
        (Op.PUSH, {"lr_scale": 2.0}, "lr_scale"),
        (Op.PUSH, {"overhead_s": -1.0}, "overhead_s"),
        (Op.PUSH, {"overhead_s": float("nan")}, "overhead_s"),
        (Op.PUSH, {"compute_s": float("inf")}, "finite"),
    ]
    for op, body, words in bad:
        h = wave.request(op, body=body, clock=0)
        assert h.op == "error" and h.body["code"] == "malformed", h.body
        assert words in h.body["message"], h.body
    assert service.rejected == len(bad)
