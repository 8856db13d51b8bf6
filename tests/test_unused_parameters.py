"""A model with trainable parameters its loss never uses (a spare head, a branch some steps
skip): all-reduce has DDP look for unused parameters in the first step and go on looking where
it found some (DDP alone fails at the second step), and stop looking where it found none; with
the search turned off the job ends with one line saying which setting to change. In every mode
such a parameter stays as it was, weight decay included, as torch leaves a parameter whose
gradient is None."""

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_wavelet

from wavelet.common.config import JobConfig
from wavelet.common.job import build_dataset_and_model, load_trained_model
from wavelet.common.settings import from_dict
from wavelet.worker.allreduce import UnusedParameterError

PARTS = """
import math

import torch
from torch import nn


class SpareHead(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = nn.Linear(math.prod(input_shape), 32)
        self.head = nn.Linear(32, num_classes)
        self.spare = nn.Linear(32, 5)  # never in the loss

    def forward(self, x):
        return self.head(torch.relu(self.body(x.flatten(1))))


def spare_head(input_shape, num_classes):
    return SpareHead(input_shape, num_classes)
"""


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "myparts.py").write_text(PARTS)
    return tmp_path


def _launch(project, *flags):
    return run_wavelet(
        "launch", "--mode", "allreduce", "--devices", "cpu,cpu", "--model",
        "myparts:spare_head", "--epochs", "5", "--run-dir", "run", *flags,
        timeout=170, cwd=project,
    )  # fmt: skip


@pytest.mark.timeout(180)
def test_all_reduce_trains_a_model_with_a_spare_head(project):
    done = _launch(project)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        first = _first_step(project / "run", rank)
        assert first["unused_parameters"] == ["spare.weight", "spare.bias"]
        assert first["find_unused_parameters"] is True
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.3, summary  # 3x chance: it learns


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "mode",
    [
        ("--updates", "async"),  # the policy's path on the shard
        ("--updates", "wave-turns"),  # the grouped path
    ],
    ids=["async", "wave-turns"],
)
def test_a_parameter_the_loss_never_uses_is_not_decayed_by_the_shards(project, mode, monkeypatch):
    """(All-reduce leaves it alone too: DDP's rule, which the shards now follow.)"""
    done = run_wavelet(
        "launch", *mode, "--model", "myparts:spare_head", "--optimizer", "adamw",
        "--lr", "0.01", "--set", "optimizer.kwargs.weight_decay=0.1", "--epochs", "1",
        "--run-dir", "run", timeout=170, cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    monkeypatch.syspath_prepend(str(project))  # the user's module, as the run imported it
    try:
        trained = load_trained_model(project / "run").state_dict()
        _, initial = build_dataset_and_model(_job(project / "run"))
    finally:  # other tests' modules of that name hold other models
        sys.modules.pop("myparts", None)
    for name, before in initial.state_dict().items():
        if name.startswith("spare."):
            assert torch.equal(trained[name], before), name
        else:
            assert not torch.equal(trained[name], before), name  # it trained


def _job(run_dir: Path):
    return from_dict(JobConfig, json.loads((run_dir / "job.json").read_text()))


@pytest.mark.timeout(180)
def test_a_model_that_uses_every_parameter_stops_the_search_after_one_step(project):
    done = run_wavelet(
        "launch", "--mode", "allreduce", "--devices", "cpu,cpu", "--epochs", "2",
        "--run-dir", "run", timeout=170, cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        first = _first_step(project / "run", rank)
        assert first["unused_parameters"] == [] and first["find_unused_parameters"] is False
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.5, summary  # trained on after DDP was made again


def _first_step(run_dir: Path, rank: int) -> dict:
    path = run_dir / "records" / f"worker-{rank}-wave-0.jsonl"
    return next(r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "step")


@pytest.mark.timeout(180)
def test_turning_the_search_off_ends_the_job_with_the_setting_to_change(project):
    done = _launch(project, "--set", "find_unused_parameters=never")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "got no gradient in step 1 (counting from 1)" in done.stderr, done.stderr[-3000:]
    assert 'set find_unused_parameters = "auto"' in done.stderr


def test_the_error_says_what_to_set():
    assert 'or "always"' in str(UnusedParameterError("never", False, 3))
    assert "the first step gave every parameter one" in str(UnusedParameterError("auto", False, 3))
    assert "let every output of the forward count" in str(UnusedParameterError("auto", True, 3))
