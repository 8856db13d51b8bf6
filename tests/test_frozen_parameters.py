"""Frozen parameters (``requires_grad=False``, a pretrained backbone being fine-tuned) never
travel between waves and shards: as DDP keeps them each rank's own once it starts, they stay
each wave's own, equal everywhere at the start, which the plan's fingerprint checks."""

import json
import math

import pytest
import torch
from conftest import run_wavelet
from torch import nn

from wavelet.common.config import JobConfig
from wavelet.common.job import build_dataset_and_model, load_trained_model
from wavelet.common.protocol import ErrorCode, ProtocolError
from wavelet.common.settings import from_dict
from wavelet.common.sharding import ShardingPlan
from wavelet.ps.shard import Shard

PARTS = """
import math

import torch
from torch import nn


class Backbone(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.backbone = nn.Linear(math.prod(input_shape), 256)
        self.backbone.requires_grad_(False)  # pretrained: only the head is fine-tuned
        self.norm = nn.BatchNorm1d(256)
        self.head = nn.Linear(256, num_classes)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.backbone(x.flatten(1)))))


def backbone(input_shape, num_classes):
    return Backbone(input_shape, num_classes)
"""


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.Linear(64, 3))
    m[0].requires_grad_(False)
    return m


def test_a_plan_holds_no_frozen_parameter_and_fingerprints_their_values():
    plan = ShardingPlan.for_model(_model(0), 2, 4 << 20)
    assert {c.name for c in plan.chunks} == {
        "1.weight", "1.bias", "2.weight", "2.bias",
        "1.running_mean", "1.running_var", "1.num_batches_tracked",
    }  # fmt: skip
    assert ShardingPlan.for_model(_model(0), 2, 4 << 20).fingerprint == plan.fingerprint
    other = _model(0)
    with torch.no_grad():
        other[0].weight[0, 0] += 1e-3  # the same model but one frozen value
    assert ShardingPlan.for_model(other, 2, 4 << 20).fingerprint != plan.fingerprint
    # the trainable part alone does not decide: unfreezing changes the plan too
    assert ShardingPlan.for_model(_model(0).requires_grad_(True), 2, 4 << 20) != plan


def test_a_wave_whose_frozen_parameters_differ_is_refused_by_name():
    shard = Shard(JobConfig().optimizer)
    shard.initialize(
        ShardingPlan.for_model(_model(0), 1, 4 << 20).fingerprint, [0], [torch.zeros(3)], [True]
    )
    with pytest.raises(ProtocolError, match="frozen parameters") as e:
        shard.check_plan(ShardingPlan.for_model(_model(1), 1, 4 << 20).fingerprint)
    assert e.value.code == ErrorCode.PLAN_MISMATCH


@pytest.mark.timeout(180)
def test_fine_tuning_a_head_moves_only_its_bytes_and_keeps_the_backbone(tmp_path, monkeypatch):
    (tmp_path / "backboneparts.py").write_text(PARTS)
    done = run_wavelet(
        "launch", "--model", "backboneparts:backbone", "--transport", "tcp", "--epochs", "3",
        "--run-dir", "run", timeout=170, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    job = from_dict(JobConfig, json.loads((run / "job.json").read_text()))
    _, initial = build_dataset_and_model(job)
    # what travels: the head and the norm's parameters and statistics, up and back
    moved = sum(
        t.numel() * t.element_size()
        for n, t in initial.state_dict().items()
        if not n.startswith("backbone.")
    )
    steps = [
        json.loads(line)
        for line in (run / "records" / "worker-0-wave-0.jsonl").read_text().splitlines()
    ]
    wire = {r["wire_bytes"] for r in steps if r["kind"] == "step"}
    assert wire == {2 * moved}, (wire, moved)
    backbone = math.prod(initial.backbone.weight.shape) * 4
    assert moved < backbone / 4  # the frozen backbone was most of the model
    trained = load_trained_model(run)
    assert torch.equal(trained.backbone.weight, initial.backbone.weight)
    assert not torch.equal(trained.head.weight, initial.head.weight)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.5, summary  # a random backbone, a trained head
