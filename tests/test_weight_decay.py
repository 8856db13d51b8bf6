"""``optimizer.weight_decay_on = "matrices"``: weight decay only on parameters of two or more
dimensions, none on biases and norm scales, in every mode; a shard learns each chunk's
dimensions from the wave that seeds it and keeps them in its checkpoint."""

import json

import pytest
import torch
from conftest import run_wavelet

from wavelet.common.config import JobConfig
from wavelet.common.job import build_dataset_and_model, load_trained_model
from wavelet.common.optimizer import OptimizerConfig
from wavelet.common.settings import ConfigError, from_dict
from wavelet.ps.shard import Shard

# a step whose gradients are all zero: AdamW then moves a parameter by its weight decay alone
ZERO_STEP = """
def zero_loss(model, batch):
    x, _ = batch
    return (model(x) * 0.0).sum()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "mode", [(), ("--mode", "allreduce", "--devices", "cpu,cpu")], ids=["ps", "allreduce"]
)
def test_weight_decay_spares_biases_when_asked(tmp_path, mode, monkeypatch):
    (tmp_path / "zerostep.py").write_text(ZERO_STEP)
    done = run_wavelet(
        "launch", *mode, "--step", "zerostep:zero_loss", "--optimizer", "adamw",
        "--lr", "0.01", "--set", "optimizer.kwargs.weight_decay=0.5", "--weight-decay-on",
        "matrices", "--epochs", "1", "--run-dir", "run",
        timeout=170, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    monkeypatch.syspath_prepend(str(tmp_path))
    trained = load_trained_model(tmp_path / "run").state_dict()
    job = from_dict(JobConfig, json.loads((tmp_path / "run" / "job.json").read_text()))
    assert job.optimizer.weight_decay_on == "matrices"
    _, initial = build_dataset_and_model(job)
    assert {p.dim() >= 2 for p in initial.parameters()} == {True, False}  # both kinds
    for name, before in initial.named_parameters():
        decayed = not torch.equal(trained[name], before.detach())
        assert decayed == (before.dim() >= 2), name
        if decayed:  # shrunk toward zero, not moved by a gradient
            assert trained[name].abs().sum() < before.detach().abs().sum(), name


@pytest.mark.parametrize("on", ["all", "matrices"])
def test_zero_gradients_move_a_shards_chunks_by_their_weight_decay_alone(on):
    """The control of the launches above, on a shard: the same zero gradients decay biases too
    under the default (all), so that sparing them is the setting's doing."""
    adamw = OptimizerConfig(name="adamw", lr=0.01, kwargs={"weight_decay": 0.5}, weight_decay_on=on)
    values = [torch.randn(12), torch.randn(3)]
    shard = Shard(adamw)
    shard.initialize("plan", [0, 1], values, [True, True], ndims=[2, 1])
    shard.apply({k: torch.zeros_like(v) for k, v in zip(shard.keys, values, strict=True)})
    matrix, bias = shard.values()
    assert matrix.abs().sum() < values[0].abs().sum()  # shrunk toward zero
    assert torch.equal(bias, values[1]) == (on == "matrices")


def test_a_shard_keeps_its_groups_through_a_checkpoint():
    adamw = OptimizerConfig(
        name="adamw", lr=0.1, kwargs={"weight_decay": 0.1}, weight_decay_on="matrices"
    )
    values = [torch.randn(12), torch.randn(3), torch.randn(5)]
    shard = Shard(adamw)
    shard.initialize("plan", [0, 1, 2], values, [True, True, True], ndims=[2, 1, 4])
    groups = shard.optimizer.param_groups
    assert [len(g["params"]) for g in groups] == [2, 1]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    shard.apply({k: torch.ones_like(v) for k, v in zip(shard.keys, values, strict=True)})
    restored = Shard(adamw)
    restored.load_state_dict(shard.state_dict())  # the optimizer's state fits its groups
    assert [len(g["params"]) for g in restored.optimizer.param_groups] == [2, 1]
    assert restored.optimizer.state_dict()["state"].keys() == {0, 1, 2}


def test_an_optimizer_without_weight_decay_cannot_spare_biases():
    with pytest.raises(ConfigError, match="rprop has no weight decay"):
        OptimizerConfig(name="rprop", lr=0.01, weight_decay_on="matrices")
    with pytest.raises(ConfigError, match="matrices"):
        OptimizerConfig(name="adamw", weight_decay_on="vectors")
