"""A push over TCP in parts (ps/push_parts.py): parts are kept and never answered, the last one
stands for the whole push, and whatever is wrong with any part refuses the whole push and
changes nothing. In-process shard, real messages through ``service.handle``."""

import pytest
import torch
from conftest import run_wavelet
from helpers import ServiceWave, service_for

from wavelet.common.protocol import Op
from wavelet.common.records import read_records


def _grads(wave: ServiceWave, value: float) -> dict[int, torch.Tensor]:
    return {c.key: torch.full((c.numel,), value) for c in wave.chunks}


def _part(wave: ServiceWave, keys, grads, clock=0, more=True, read=0):
    body = {"more": True} if more else {}
    return wave.send(
        Op.PUSH_PULL,
        [grads[k] for k in keys],
        clock=clock,
        read_version=read,
        keys=list(keys),
        body=body,
    )


def _joined(tmp_path):
    service = service_for(tmp_path)
    wave = ServiceWave(service)
    wave.join()
    assert len(wave.keys) >= 3, "the test needs a shard of at least three chunks"
    return service, wave


def test_a_push_in_parts_is_the_same_update_as_the_push_whole(tmp_path):
    whole_service, whole = _joined(tmp_path / "whole")
    parts_service, parted = _joined(tmp_path / "parts")
    try:
        grads = _grads(whole, 0.25)
        assert whole.push(0, 0, 0.25).op == "reply"
        keys = parted.keys
        assert _part(parted, keys[-1:], grads) == []  # a part is not answered
        assert _part(parted, keys[1:-1], grads) == []
        (reply,) = _part(parted, keys[:1], grads, more=False)
        assert reply.header.op == "reply" and reply.header.body["version"] == 1
        for a, b in zip(whole_service.shard.values(), parts_service.shard.values(), strict=True):
            assert torch.equal(a, b)
    finally:
        whole_service.close()
        parts_service.close()


def test_a_bad_part_refuses_the_whole_push_and_changes_nothing(tmp_path):
    service, wave = _joined(tmp_path)
    try:
        grads = _grads(wave, 0.5)
        keys = wave.keys
        before = [v.clone() for v in service.shard.values()]
        grads[999] = torch.zeros(3)
        for part_keys, why in (([999], "does not hold"), ([keys[0], keys[0]], "twice")):
            assert _part(wave, part_keys, grads) == []
            (reply,) = _part(wave, keys[1:], grads, more=False)
            assert reply.header.op == "error" and why in reply.header.body["message"]
        assert service.shard.version == 0
        # a push given again whole (after a recovery) stands for itself, whatever came before
        assert _part(wave, keys[:1], grads) == []
        (reply,) = _part(wave, keys, grads, more=False)
        assert reply.header.op == "reply" and service.shard.version == 1
        after_good = [v.clone() for v in service.shard.values()]
        # a last part that repeats a chunk of an earlier one
        assert _part(wave, keys[:2], grads, clock=1, read=1) == []
        (reply,) = _part(wave, keys[1:], grads, clock=1, read=1, more=False)
        assert reply.header.op == "error" and "repeats" in reply.header.body["message"]
        # NaN in a part: the whole push is refused, as in one message
        grads[keys[0]] = torch.full_like(grads[keys[0]], float("nan"))
        assert _part(wave, keys[:1], grads, clock=1, read=1) == []
        (reply,) = _part(wave, keys[1:], grads, clock=1, read=1, more=False)
        assert reply.header.op == "error" and "NaN" in reply.header.body["message"]
        assert service.shard.version == 1
        for a, b in zip(after_good, service.shard.values(), strict=True):
            assert torch.equal(a, b)  # only the good push changed anything
        assert not torch.equal(before[0], after_good[0])
    finally:
        service.close()


def test_parts_of_a_wave_that_is_not_registered_are_dropped(tmp_path):
    service, wave = _joined(tmp_path)
    try:
        stranger = ServiceWave(service, worker="stranger")
        grads = _grads(stranger, 0.1)
        assert _part(stranger, stranger.keys[:1], grads) == []
        assert service.push_parts.waves == {}
        wave.request(Op.LEAVE)
        assert _part(wave, wave.keys[:1], _grads(wave, 0.1)) == []
        assert service.push_parts.waves == {}
    finally:
        service.close()


@pytest.mark.timeout(240)
def test_a_job_over_tcp_pushes_in_parts_when_asked(tmp_path):
    run_dir = tmp_path / "run"
    done = run_wavelet(
        "launch", "--run-dir", str(run_dir), "--transport", "tcp", "--push-part-kib", "1",
        "--epochs", "1", timeout=200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [
        r
        for path in (run_dir / "records").glob("worker-*-wave-*.jsonl")
        for r in read_records(path)
        if r["kind"] == "step"
    ]
    assert steps and all(r["transport"] == ["tcp", "tcp"] for r in steps)
    assert sum(r["pushed_in_parts"] for r in steps) > 0  # chunks went ahead of their push
