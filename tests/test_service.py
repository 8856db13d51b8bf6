"""ShardService in-process, without sockets: the rules of a shard, fast."""

import pytest
import torch
from helpers import tiny_model

from wavelet.common.config import JobConfig, PSConfig
from wavelet.common.protocol import Header, Op, decode, encode
from wavelet.common.sharding import ShardingPlan, chunk_view, model_tensors
from wavelet.ps.service import ShardService

PEER = b"peer"


class Wave:
    """Frames a wave would send to a one-shard job, and the replies, through ``service.handle``."""

    def __init__(self, service: ShardService, worker: str = "w0"):
        self.service = service
        self.model = tiny_model()
        self.plan = ShardingPlan.for_model(self.model, 1, 4 << 20)
        self.tensors = {n: t for n, t, _ in model_tensors(self.model)}
        self.chunks = self.plan.for_shard(0)
        self.worker = worker

    def request(self, op: Op, tensors=(), **fields) -> Header:
        h = Header(op=op, worker=self.worker, wave=0, plan=self.plan.fingerprint, **fields)
        out = self.service.handle(PEER, [bytes(f) for f in encode(h, list(tensors))])
        assert len(out) == 1, out
        header, _ = decode([out[0].header.pack(), *(bytes(t.numpy()) for t in out[0].tensors)])
        return header

    def join(self, resume: bool = False) -> Header:
        h = self.request(Op.REGISTER, clock=0, body={"resume": resume})
        if not h.body["initialized"]:
            values = [chunk_view(self.tensors[c.name].detach(), c) for c in self.chunks]
            trainable = [c.trainable for c in self.chunks]
            assert self.request(Op.INIT, values, keys=self.keys, body={"trainable": trainable})
        return h

    @property
    def keys(self) -> list[int]:
        return [c.key for c in self.chunks]

    def push(self, clock: int, read: int, value: float = 0.1) -> Header:
        grads = [torch.full((c.numel,), value) for c in self.chunks]
        return self.request(Op.PUSH, grads, clock=clock, read_version=read, keys=self.keys)


def _service(tmp_path, **ps) -> ShardService:
    job = JobConfig(model="mlp", dataset="synthetic", shards=1, staleness=float("inf"))
    return ShardService(PSConfig(job=job, run_dir=str(tmp_path), **ps), admin_token="secret")


def test_a_failing_periodic_checkpoint_is_counted_and_retried(tmp_path):
    service = _service(tmp_path, checkpoint_every=1)
    wave = Wave(service)
    wave.join()
    (tmp_path / "checkpoints").write_text("a file where the folder belongs")  # writes fail
    for clock in range(3):
        assert wave.push(clock, clock).op == "reply"
    assert service.checkpoint_failures == 3
    stats = wave.request(Op.STATS)
    assert stats.body["checkpoint_failures"] == 3 and stats.body["version"] == 3
    (tmp_path / "checkpoints").unlink()  # the disk is fine again: the next interval writes
    assert wave.push(3, 3).op == "reply"
    assert (tmp_path / "checkpoints" / "shard-0.pt").exists()
    assert service.checkpoint_failures == 3


def test_updates_lost_to_an_old_checkpoint_are_reported_on_resume(tmp_path):
    service = _service(tmp_path, checkpoint_every=5)
    wave = Wave(service)
    wave.join()
    for clock in range(7):  # versions 1..7; the checkpoint holds version 5
        wave.push(clock, clock)
    service.push_log.close()  # a kill -9: no final checkpoint
    restarted = _service(tmp_path, checkpoint_every=5)
    assert restarted.shard.version == 5 and restarted.lost_on_restore == 2
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
    ]
    for op, body, words in bad:
        h = wave.request(op, body=body, clock=0)
        assert h.op == "error" and h.body["code"] == "malformed", h.body
        assert words in h.body["message"], h.body
    assert service.rejected == len(bad)
