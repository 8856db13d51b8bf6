"""Batches of any form a user's collate_fn makes (a dict of tensors, a tuple of three, named
tuples, nested): every mode moves them to its device whole and counts samples by the leading
dimension, the user's step and evaluation read them as they are, and the built-in step and
evaluation, which need (inputs, targets) and a tensor of logits, refuse other forms before
anything starts."""

import json
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from conftest import ONE_SHARD, run_wavelet

from wavelet.common.batches import batch_samples, cloned, pair, to_device
from wavelet.common.evaluation import EvaluateError, Evaluation
from wavelet.common.step import StepError, TrainingStep

PARTS = """
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


class Points(Dataset):
    num_classes = 2

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, :4].sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def points(seed):
    return Points(512, seed), Points(128, seed + 1)


def as_dict(samples):
    xs, ys = zip(*samples)
    return {"features": torch.stack(xs), "label": torch.stack(ys), "note": "kept as it is"}


def dict_step(model, batch):
    assert batch["note"] == "kept as it is"
    return F.cross_entropy(model(batch["features"]), batch["label"])


def dict_accuracy(model, batches):
    right = seen = 0
    for b in batches:
        right += int((model(b["features"]).argmax(1) == b["label"]).sum())
        seen += len(b["label"])
    return {"accuracy": right / seen}
"""

Pair = namedtuple("Pair", "inputs targets")


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "myforms.py").write_text(PARTS)
    return tmp_path


def test_a_batch_moves_whole_and_keeps_its_form():
    batch = {
        "x": torch.zeros(3, 2),
        "parts": [torch.ones(3), (torch.arange(3), "tag")],
        "pair": Pair(torch.zeros(3), torch.ones(3)),
        "n": 7,
    }
    moved = to_device(batch, "meta")
    assert moved["x"].device.type == "meta" and moved["parts"][1][0].device.type == "meta"
    assert moved["parts"][1][1] == "tag" and moved["n"] == 7
    assert isinstance(moved["pair"], Pair) and moved["pair"].targets.device.type == "meta"
    assert isinstance(moved["parts"], list) and isinstance(moved["parts"][1], tuple)
    copy = cloned(batch)
    assert copy["x"] is not batch["x"] and torch.equal(copy["x"], batch["x"])


def test_samples_are_the_first_tensors_leading_dimension():
    assert batch_samples((torch.zeros(5, 3), torch.zeros(5))) == 5
    assert batch_samples({"ids": [torch.zeros(4, 9)], "y": torch.zeros(4)}) == 4
    with pytest.raises(ValueError, match="holds no tensor with a batch dimension"):
        batch_samples({"text": ["a", "b"]})


def test_the_builtin_step_and_evaluation_name_the_form_they_need():
    model = torch.nn.Linear(8, 2)
    batch = {"features": torch.zeros(4, 8), "label": torch.zeros(4, dtype=torch.long)}
    with pytest.raises(StepError, match="with keys features, label: .*your own --step"):
        TrainingStep()(model, batch)
    with pytest.raises(EvaluateError, match="evaluation accuracy takes batches of"):
        Evaluation()(model, [batch])
    x, y = pair(Pair(torch.zeros(4, 8), torch.zeros(4)), "step")  # a named pair is a pair
    assert x.shape == (4, 8)


def test_the_builtin_step_on_dict_batches_is_refused_before_start(project):
    done = run_wavelet(
        "launch", "--dataset", "myforms:points", "--collate-fn", "myforms:as_dict",
        "--model", "mlp", "--epochs", "1", "--run-dir", "run", timeout=100, cwd=project,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "a dict with keys features, label, note" in done.stderr
    assert not (project / "run" / "logs").exists()  # no daemon started


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_dict_batches_train_with_the_users_step_and_evaluation(project, mode):
    done = run_wavelet(
        "launch", *ONE_SHARD, "--mode", mode, "--dataset", "myforms:points", "--collate-fn",
        "myforms:as_dict", "--step", "myforms:dict_step", "--evaluate",
        "myforms:dict_accuracy", "--model", "mlp", "--epochs", "3", "--threads", "1",
        "--run-dir", "run", timeout=220, cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.75, summary  # chance is 0.5
    steps = [
        json.loads(line)
        for path in (project / "run" / "records").glob("worker-*.jsonl")
        for line in path.read_text().splitlines()
    ]
    samples = {r["samples"] for r in steps if r["kind"] == "step"}
    assert samples and samples == {r["batch_size"] for r in steps if r["kind"] == "start"}


class DictOutput(torch.nn.Linear):
    def forward(self, x):
        return {"logits": super().forward(x)}


def test_the_builtin_step_and_evaluation_name_model_outputs_they_cannot_read():
    model, batch = DictOutput(8, 2), (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(StepError, match="returned a dict with keys logits, not a tensor"):
        TrainingStep()(model, batch)
    with pytest.raises(EvaluateError, match="returned a dict with keys logits, not a tensor"):
        Evaluation()(model, [batch])
