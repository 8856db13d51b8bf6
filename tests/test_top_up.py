"""Top-ups under wave turns (worker/top_up.py, ps/ready.py): shard 0 answers a wave's ``ready``
once every wave of its group has finished its batch or pushed, and not before; a topped-up step
is one process's step on all its samples (to 1e-5); a job with top-ups pushes what its waves
computed, sample for sample; and the setting's bad combinations get one clear line."""

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_wavelet
from helpers import ServiceWave, reply_of, service_for

from wavelet.common.config import JobConfig
from wavelet.common.datasets import DataPart
from wavelet.common.protocol import Op
from wavelet.worker.compute import InlineCompute
from wavelet.worker.top_up import TopUp


def _turns(tmp_path, **job):
    return service_for(tmp_path, job={"updates": "wave-turns", "staleness": 1, **job}, shm=False)


def _ops(out) -> list[tuple[str, int]]:
    """(op, request id) of every message the service sent."""
    return [(reply_of(m).op, reply_of(m).request_id) for m in out]


def test_ready_is_answered_once_the_whole_group_is_ready(tmp_path):
    service = _turns(tmp_path)
    try:
        a, b = ServiceWave(service, "a"), ServiceWave(service, "b")  # both tick: one group
        tock = ServiceWave(service, "a", wave=1)  # another group: never waited for
        for w in (a, b, tock):
            w.join()
        assert a.send(Op.READY, clock=0, request_id=7) == []  # b has not finished: it waits
        out = b.send(Op.READY, clock=0, request_id=8)
        assert sorted(_ops(out)) == [("reply", 7), ("reply", 8)]  # b completes the group
        a.push(0, 0)
        b.push(0, 0)  # the turn of clock 0 closes: version 1
        assert service.shard.version == 1
        # b pushes clock 1 without saying it is ready (top-ups off there): that counts too
        assert a.send(Op.READY, clock=1, request_id=9) == []
        # the tock group is tock alone: a and b, still at clock 1 of theirs, are no part of it
        assert _ops(tock.send(Op.READY, clock=0, request_id=10)) == [("reply", 10)]
        out = b.send(Op.PUSH, *_grads(b), clock=1, read_version=1, keys=b.keys)
        assert ("reply", 9) in _ops(out)
    finally:
        service.close()


def _grads(w: ServiceWave):
    return ([torch.full((c.numel,), 0.1) for c in w.chunks],)


def test_a_wave_that_leaves_releases_the_group_and_its_own_wait_is_answered(tmp_path):
    service = _turns(tmp_path)
    try:
        a, b, c = (ServiceWave(service, name) for name in "abc")
        for w in (a, b, c):
            w.join()
        assert a.send(Op.READY, clock=0, request_id=3) == []
        assert b.send(Op.READY, clock=0, request_id=4) == []  # c is still computing
        out = c.send(Op.LEAVE, request_id=5)  # c leaves: a and b need wait no longer
        assert sorted(_ops(out)) == [("reply", 3), ("reply", 4), ("reply", 5)]
        assert a.send(Op.READY, clock=1, request_id=6) == []
        out = a.send(Op.LEAVE, request_id=7)  # a's own wait: an error, then its leave's reply
        assert [reply_of(m).body.get("code") for m in out] == ["not_registered", None]
        assert service.ready.waiting == []
    finally:
        service.close()


def test_ready_is_answered_at_once_outside_wave_turns_and_refused_to_strangers(tmp_path):
    service = service_for(tmp_path, shm=False)  # asynchronous
    try:
        a = ServiceWave(service, "a")
        a.join()
        assert _ops(a.send(Op.READY, clock=0, request_id=2)) == [("reply", 2)]
        stranger = ServiceWave(service, "nobody")  # never registered
        h = reply_of(stranger.send(Op.READY, clock=0, request_id=3)[0])
        assert h.op == "error" and h.body["code"] == "not_registered"
    finally:
        service.close()


def test_a_topped_up_step_is_one_process_on_all_its_samples():
    """A batch of 12, then extra batches of 5 until the group is ready after the second: the
    gradient is the mean over all 22 samples, as one process's backward on them gives it."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    part = DataPart(x, y, 0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference.load_state_dict(model.state_dict())

    def step(m, batch):
        inputs, targets = batch
        return F.cross_entropy(m(inputs), targets), {}

    job = JobConfig(batch_size=12, top_up=True, top_up_samples=5, updates="wave-turns")
    top_up = TopUp(part, job, step, InlineCompute(), torch.device("cpu"), 0, threading.Event())
    base = (x[:12], y[:12])
    step(model, base)[0].backward()
    calls = []
    extra, _ = top_up.accumulate_until(model, 12, lambda: len(calls.append(1) or calls) > 2)
    assert extra == 10  # two extra batches of 5, then the group was ready
    drawn = list(part.batches(5, 0, top_up.seed))[:2]  # the top-ups' own order over the part
    all_x = torch.cat([base[0], *(b[0] for b in drawn)])
    all_y = torch.cat([base[1], *(b[1] for b in drawn)])
    step(reference, (all_x, all_y))[0].backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5)
    # never more than the step's own batch: a group that never gets ready costs one batch
    model.zero_grad()
    step(model, base)[0].backward()
    assert top_up.accumulate_until(model, 12, lambda: False)[0] == 12  # 5 + 5 + the 2 left


def test_a_job_with_top_ups_pushes_what_its_waves_computed(tmp_path):
    """Two CPU workers under wave turns with top-ups: every step's samples (its batch and any
    top-ups) are what its push told each shard, and the job trains to its end."""
    run = tmp_path / "run"
    done = run_wavelet(
        "launch", "--devices", "cpu,cpu", "--updates", "wave-turns", "--top-up", "true",
        "--epochs", "2", "--run-dir", str(run), "--quiet", timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    steps = {}
    for log in (run / "records").glob("worker-*-wave-*.jsonl"):
        for r in map(json.loads, log.read_text().splitlines()):
            if r.get("kind") == "step":
                steps[r["wave_name"], r["clock"]] = r
                assert 0 <= r["top_up_samples"] <= r["samples"] - r["top_up_samples"]
    assert steps
    for shard in (0, 1):
        pushes = _records(run / "records" / f"ps-{shard}-pushes.jsonl")
        told = {(p["wave_name"], p["clock"]): p["samples"] for p in pushes}
        for key, r in steps.items():
            assert told[key] == r["samples"], (shard, key)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.5


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--top-up", "true", "--updates", "async"], "top_up is for wave turns"),
        (["--top-up", "true", "--precision", "fp16"], "precision = fp16"),
        (["--top-up-samples", "-1"], "top_up_samples must be >= 0"),
    ],
)
def test_top_up_settings_that_cannot_work_are_refused(args, words):
    bad = run_wavelet("launch", *args, timeout=60)
    assert bad.returncode == 2 and words in bad.stderr, bad.stderr
