"""A user's own step of training (``--step package.module:function``): it trains in every mode,
its logs reach the records, and a step that returns no loss ends the job with one line naming
it (before start, exit 2, when it cannot even be imported)."""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import ONE_SHARD, run_wavelet
from helpers import tiny_model

from wavelet.common.step import StepError, TrainingStep
from wavelet.scripts.report import Progress

STEPS = """
import itertools
import math

import torch
import torch.nn.functional as F


def smooth(model, batch):
    x, y = batch
    out = model(x)
    acc = (out.argmax(1) == y).float().mean().item()
    return F.cross_entropy(out, y, label_smoothing=0.1), {"batch_acc": acc}


def per_sample(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def one_output(input_shape):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), 1))


def broken_model(input_shape, num_classes):
    raise KeyError("width")


_calls = itertools.count()  # of this process: one worker's waves share it


def fails_once(model, batch):
    # the tenth step of the worker fails, in whichever wave takes it
    if next(_calls) == 10:
        raise RuntimeError("this step fails once")
    x, y = batch
    return F.cross_entropy(model(x), y)
"""


@pytest.fixture
def project(tmp_path) -> Path:
    """A user's project folder with their steps module (importable from there, as `-m` adds the
    working directory to the path of the launcher and of every daemon it starts)."""
    (tmp_path / "mysteps.py").write_text(STEPS)
    return tmp_path


def _step_logs(run_dir: Path) -> list[dict]:
    logs = []
    for path in (run_dir / "records").glob("worker-*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["kind"] == "step":
                logs.append(r.get("step_logs"))
    return logs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_a_users_step_trains_and_logs(project, mode):
    done = run_wavelet(
        "launch", *ONE_SHARD, "--mode", mode, "--step", "mysteps:smooth", "--epochs", "2",
        "--run-dir", "run", timeout=220, cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.3, summary  # 3x chance after 2 epochs: it learns
    logs = _step_logs(project / "run")
    assert logs and all(0.0 <= entry["batch_acc"] <= 1.0 for entry in logs)


def _refused_before_start(project, *flags: str) -> str:
    """Launch with ``flags``: refused with exit status 2 before any daemon starts; its stderr."""
    done = run_wavelet("launch", *flags, "--epochs", "1", "--run-dir", "run", timeout=100,
                       cwd=project)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert not (project / "run" / "logs").exists()  # no daemon started
    return done.stderr


def test_a_step_that_returns_no_loss_is_refused_before_anything_starts(project):
    said = _refused_before_start(project, "--step", "mysteps:per_sample")
    assert "step mysteps:per_sample returned a tensor of shape (16,), not a scalar" in said
    assert "before training" in said


def test_a_model_factory_that_raises_is_one_line_naming_where(project):
    (line,) = _refused_before_start(project, "--model", "mysteps:broken_model").strip().splitlines()
    assert "KeyError: 'width' (raised at " in line and "mysteps.py:" in line  # no traceback


def test_the_default_step_refuses_a_model_with_one_output(project):
    # a regression model trained by the classification step: cross-entropy over one class is 0
    # whatever the model does, so the job would "train" and learn nothing
    said = _refused_before_start(project, "--model", "mysteps:one_output")
    assert "output has shape (16, 1)" in said and "--step" in said
    one = torch.nn.Linear(4, 1)
    with pytest.raises(StepError, match="2 or more classes"):
        TrainingStep("classification")(one, (torch.randn(3, 4), torch.zeros(3, 1)))


@pytest.mark.timeout(180)
def test_a_wave_whose_step_fails_leaves_the_shards_and_the_other_trains_to_the_end(project):
    """The failed wave leaves at once, so the wave it would hold back (wave turns, the default on
    a CPU; or the staleness bound) goes on now, not after wave_timeout_s (an hour here)."""
    done = run_wavelet(
        "launch", *ONE_SHARD,
        "--step", "mysteps:fails_once", "--epochs", "2", "--threads", "1",
        "--set", "wave_timeout_s=3600", "--run-dir", "run", timeout=170, cwd=project,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    failed = re.findall(r"wave (w0/\d) failed: this step fails once", done.stderr)
    assert len(failed) == 1, done.stderr[-3000:]
    log = (project / "run" / "logs" / "ps-0.log").read_text()
    left = dict(re.findall(r"wave (w0/\d) left at clock (\d+)", log))
    assert set(left) == {"w0/0", "w0/1"} and "silent for over" not in log, log[-3000:]
    (other,) = set(left) - set(failed)
    assert int(left[failed[0]]) < int(left[other])  # the other one trained on to its end
    records = project / "run" / "records" / f"worker-0-wave-{other[-1]}.jsonl"
    steps = [json.loads(line) for line in records.read_text().splitlines()]
    assert max(r["epoch"] for r in steps if r["kind"] == "step") == 1  # both epochs
    # the failed wave says so in its records, and the progress line stops counting its loss
    mine = project / "run" / "records" / f"worker-0-wave-{failed[0][-1]}.jsonl"
    last = json.loads(mine.read_text().splitlines()[-1])
    assert last["kind"] == "failed" and last["error"] == "RuntimeError: this step fails once"
    progress = Progress(project / "run", epochs=2)
    progress.read()
    assert set(progress.loss) == {other}


def test_a_step_that_cannot_be_imported_is_refused_before_start(project):
    done = run_wavelet("launch", "--step", "mysteps:missing", "--run-dir", "run", timeout=60,
                       cwd=project)  # fmt: skip
    assert done.returncode == 2
    assert "cannot load the job's step" in done.stderr and "missing" in done.stderr
    assert not (project / "run" / "records").exists()


def test_what_a_step_returns_is_checked():
    model = tiny_model()
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    step = TrainingStep("classification")
    loss, logs = step(model, (x, y))
    assert loss.shape == () and loss.requires_grad and logs == {}
    bad = [
        (1.5, "returned float, not a loss tensor"),
        (torch.ones(3, requires_grad=True), "shape (3,), not a scalar"),
        (torch.tensor(1.0), "does not require grad"),
        ((torch.ones((), requires_grad=True), [1]), "returned list as its logs"),
        ((torch.ones((), requires_grad=True), {"x": "high"}), "not a number"),
    ]
    for out, message in bad:
        with pytest.raises(StepError, match=message.replace("(", r"\(").replace(")", r"\)")):
            step.check(out)
    loss, logs = step.check((torch.ones(1, requires_grad=True), {"acc": torch.tensor(0.5)}))
    assert loss.shape == () and logs == {"acc": 0.5}


def test_bf16_runs_the_forward_under_autocast_and_keeps_fp32_parameters():
    model = tiny_model()
    seen = []
    model.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    loss, _ = TrainingStep("classification", "bf16")(model, (x, y))
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32
    loss.backward()
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters()
    )
    fp32 = TrainingStep("classification")(tiny_model(), (x, y))[0]
    assert abs(loss.item() - fp32.item()) < 0.05  # the same loss, rounded


@pytest.mark.timeout(180)
def test_a_bf16_job_trains_and_says_so(tmp_path):
    done = run_wavelet(
        "launch", *ONE_SHARD,
        "--precision", "bf16", "--epochs", "2", "--run-dir", str(tmp_path / "run"),
        timeout=170,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.5, summary  # 5x chance after 2 epochs
    starts = [
        json.loads(line)
        for path in (tmp_path / "run" / "records").glob("worker-*.jsonl")
        for line in path.read_text().splitlines()
        if '"kind": "start"' in line
    ]
    assert starts and all(r["precision"] == "bf16" for r in starts)
