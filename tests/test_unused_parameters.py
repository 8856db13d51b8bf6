"""A model with trainable parameters its loss never uses (a spare head, a branch some steps
skip): all-reduce finds them at the start and has DDP look for unused parameters, where DDP
alone fails at the second step; with the search turned off the job ends with one line saying
which setting to change."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_wavelet
from torch import nn

from wavelet.common.config import JobConfig
from wavelet.common.datasets import build_dataset
from wavelet.worker.allreduce import UnusedParameterError, unused_parameters

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


class WithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(64)
        self.used = nn.Linear(64, 10)
        self.unused = nn.Linear(64, 10)

    def forward(self, x):
        return self.used(self.norm(x.flatten(1)))


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
        path = project / "run" / "records" / f"worker-{rank}-wave-0.jsonl"
        start = json.loads(path.read_text().splitlines()[0])
        assert start["unused_parameters"] == ["spare.weight", "spare.bias"]
        assert start["find_unused_parameters"] is True
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.3, summary  # 3x chance: it learns


@pytest.mark.timeout(180)
def test_turning_the_search_off_ends_the_job_with_the_setting_to_change(project):
    done = _launch(project, "--set", "find_unused_parameters=never")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "got no gradient in step 1 (counting from 1)" in done.stderr, done.stderr[-3000:]
    assert 'set find_unused_parameters = "auto"' in done.stderr


def test_the_check_names_unused_parameters_and_changes_nothing():
    job = JobConfig(batch_size=8)
    model = WithNorm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert unused_parameters(model, build_dataset("digits", 0), job) == [
        "unused.weight",
        "unused.bias",
    ]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters())
    assert (
        unused_parameters(
            model, build_dataset("digits", 0), JobConfig(find_unused_parameters="always")
        )
        == []
    )  # only auto looks


def test_the_error_says_what_to_set():
    assert '= "always"' in str(UnusedParameterError("auto", [], 3))
    assert "same parameters unused" in str(UnusedParameterError("auto", ["a.weight"], 3))
