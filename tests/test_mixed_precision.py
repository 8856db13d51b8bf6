"""fp16 compute: a per-wave loss scale; a step whose gradients overflow is skipped and the shards
are told, so clocks, the staleness bound and bulk-synchronous sums go on (nothing hangs); skips
are counted in records, stats and the summary. All-reduce mode uses torch's GradScaler."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_wavelet
from helpers import ServiceWave, service_for, tiny_model

from wavelet.common.protocol import ErrorCode, Op
from wavelet.worker.loss_scale import LossScale

# A user's step whose first OVERFLOWS losses (in this process) are finite in fp32 but overflow
# once the loss scale multiplies them: their gradients are Inf, as fp16 overflows make them.
STEPS = """
import torch.nn.functional as F

OVERFLOWS = 3
calls = 0


def overflow_first(model, batch):
    global calls
    calls += 1
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    return loss * 1e38 if calls <= OVERFLOWS else loss
"""


def test_the_loss_scale_backs_off_on_overflow_and_grows_after_good_steps():
    model = tiny_model()
    scale = LossScale(enabled=True, init_scale=1024.0, growth_interval=2)
    x = torch.randn(4, 4)
    scale.scale(model(x).sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert scale.unscale(model)  # finite: unscaled in place
    model.zero_grad()
    model(x).sum().backward()
    for got, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(got / 1024.0, p.grad)
    scale.update(True)
    scale.update(True)
    assert scale.value == 2048.0
    next(model.parameters()).grad[0, 0] = float("inf")
    assert not scale.unscale(model)
    scale.update(False)
    assert (scale.value, scale.skipped) == (1024.0, 1)
    off = LossScale(enabled=False)
    loss = torch.tensor(3.0)
    assert off.scale(loss) is loss and off.unscale(model) and off.value == 1.0


def _skip(wave: ServiceWave, clock: int, read: int, **body):
    return wave.request(
        Op.PUSH, clock=clock, read_version=read, keys=[], body={"skip": True, **body}
    )


def test_a_skipped_step_passes_the_clock_without_changing_the_weights(tmp_path):
    service = service_for(tmp_path, job={"staleness": 1})
    a, b = ServiceWave(service, "w0"), ServiceWave(service, "w1")
    a.join(), b.join()
    version = service.shard.version
    reply = _skip(a, 0, version)
    assert reply.op == Op.REPLY and reply.body["action"] == "skipped"
    assert service.shard.version == version
    assert service.stats[("w0", 0)].skipped == 1
    assert service.stats[("w0", 0)].pushes == 0
    assert service.clocks.clocks[("w0", 0)] == 1
    # the clock passed: a's next step is clock 1, and b's push at clock 0 still applies
    assert a.push(1, version).op == Op.REPLY
    assert b.push(0, version).op == Op.REPLY
    assert service.shard.version == version + 2


def test_a_skip_that_carries_gradients_is_refused(tmp_path):
    service = service_for(tmp_path)
    wave = ServiceWave(service)
    wave.join()
    grads = [torch.zeros(c.numel) for c in wave.chunks]
    reply = wave.request(
        Op.PUSH, grads, clock=0, read_version=0, keys=wave.keys, body={"skip": True}
    )
    assert reply.body["code"] == ErrorCode.MALFORMED
    assert _skip(wave, 0, 0, shm=True).body["code"] == ErrorCode.MALFORMED
    assert service.clocks.clocks[("w0", 0)] == 0


def test_bulk_synchronous_sums_complete_over_the_waves_that_did_not_skip(tmp_path):
    service = service_for(tmp_path, job={"staleness": 0})
    a, b = ServiceWave(service, "w0"), ServiceWave(service, "w1")
    a.join(), b.join()
    assert _skip(a, 0, 0).body["action"] == "skipped"
    assert service.shard.version == 0  # b has not pushed clock 0 yet
    assert b.push(0, 0).body["action"] == "accumulated"
    assert service.shard.version == 1  # b's gradient alone made clock 0's update
    # both skip clock 1: no update, and clock 2 is open to both
    assert _skip(a, 1, 1).op == Op.REPLY and _skip(b, 1, 1).op == Op.REPLY
    assert service.shard.version == 1
    assert a.push(2, 1).op == Op.REPLY and b.push(2, 1).op == Op.REPLY
    assert service.shard.version == 2


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "fp16steps.py").write_text(STEPS)
    return tmp_path


def _records(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "records").glob("worker-*-wave-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


@pytest.mark.timeout(300)
# s = 0 end to end is the service test above: one job per mode keeps the suite short
@pytest.mark.parametrize("mode,staleness", [("ps", "1"), ("allreduce", "0")], ids=["ps", "ddp"])
def test_fp16_steps_that_overflow_are_skipped_counted_and_nothing_hangs(project, mode, staleness):
    done = run_wavelet(
        "launch", "--mode", mode, "--precision", "fp16", "--wire-dtype", "fp16",
        "--step", "fp16steps:overflow_first", "--model", "mlp", "--staleness", staleness,
        "--epochs", "3", "--threads", "1", "--run-dir", "run", timeout=280, cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in _records(project / "run") if r["kind"] == "step"]
    skipped = [r for r in steps if r["skipped"]]
    # the launcher's probes run no steps with --threads 1: the first 3 calls of the worker
    # process (the default job has one) are its first 3 steps
    assert len(skipped) == 3, [(r.get("wave_name"), r["iter"]) for r in skipped]
    assert all(r["loss_scale"] < 2.0**16 for r in steps[-2:])  # backed off
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert (summary["precision"], summary["wire_dtype"]) == ("fp16", "fp16")
    assert sum(summary["skipped_steps"].values()) == 3
    assert "skipped on fp16 overflow" in done.stdout
    assert "--precision fp16 on a CPU device" in done.stderr  # said up front, with what to use
    if mode == "ps":  # the shards counted the same skips
        assert sum(w["skipped"] for w in summary["waves"].values()) == 3
        # the loss scale needs every gradient before a push: none went out during backward
        assert all(r["pushed_in_backward"] == 0 for r in steps)
    assert summary["test_accuracy"] > 0.2  # twice chance after 3 epochs: it still learned
