"""Gradient clipping (``max_grad_norm``): each step's gradients scaled down to that L2 norm over
all of them, by each wave before it pushes (so pushes leave after backward) and by all-reduce
after averaging; the norm before clipping goes into every step record."""

import json

import pytest
import torch
from conftest import run_wavelet

from wavelet.common.config import JobConfig
from wavelet.common.job import build_dataset_and_model
from wavelet.common.settings import ConfigError
from wavelet.common.step import clip_gradients
from wavelet.worker.evaluate import evaluate


def test_clipping_scales_all_gradients_together_and_returns_the_norm_before():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)
    before = (9 * 3 + 16 * 4) ** 0.5
    assert clip_gradients([a, b], 1.0) == pytest.approx(before)
    assert torch.cat([a.grad, b.grad]).norm() == pytest.approx(1.0, rel=1e-4)
    assert a.grad[0] / b.grad[0] == pytest.approx(3 / 4)  # one scale for all


def test_a_negative_norm_is_refused():
    with pytest.raises(ConfigError, match="max_grad_norm must be >= 0"):
        JobConfig(max_grad_norm=-1.0)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_a_tiny_norm_leaves_the_model_where_it_started(tmp_path, mode):
    """Clipped to 1e-9 every step moves the weights by about lr x 1e-9: the trained model
    scores what the untrained one does, while the records say the norms were far larger."""
    done = run_wavelet(
        "launch", "--mode", mode, "--max-grad-norm", "1e-9", "--epochs", "1", "--threads", "1",
        "--run-dir", "run", timeout=140, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [
        json.loads(line)
        for path in (tmp_path / "run" / "records").glob("worker-*.jsonl")
        for line in path.read_text().splitlines()
        if '"kind": "step"' in line
    ]
    assert steps and all(r["grad_norm"] > 1e-3 for r in steps)
    if mode == "ps":
        assert all(r["pushed_in_backward"] == 0 for r in steps)  # the norm needs them all
    dataset, model = build_dataset_and_model(JobConfig())
    untrained = evaluate(model, dataset, torch.device("cpu"))["accuracy"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] == pytest.approx(untrained, abs=0.01)
