"""A job's own evaluation (``--evaluate package.module:function``) with a headline metric and its
direction: the progress line, the summary, records, TensorBoard and time to target use it, and an
evaluation that returns no headline ends the job with one line naming it."""

import json
from pathlib import Path

import pytest
import torch
from conftest import ONE_SHARD, run_wavelet
from helpers import tiny_model

from wavelet.common.evaluation import EvaluateError, Evaluation, accuracy
from wavelet.common.figures import run_figures

EVALS = """
import torch.nn.functional as F


def loss_and_accuracy(model, batches):
    total = correct = seen = 0.0
    for x, y in batches:
        out = model(x)
        total += float(F.cross_entropy(out, y, reduction="sum"))
        correct += float((out.argmax(1) == y).sum())
        seen += len(y)
    return {"test_loss": total / seen, "accuracy": correct / seen}


def headline_for_a_few_samples(model, batches):  # the launcher's check scores a few
    batches = list(batches)
    metrics = loss_and_accuracy(model, batches)
    if sum(len(y) for _, y in batches) > 16:
        del metrics["accuracy"]
    return metrics
"""


def test_the_default_is_top1_accuracy_and_a_bad_return_names_the_function():
    model = tiny_model()
    x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    got = Evaluation()(model, [(x, y)])
    assert got == accuracy(model, [(x, y)]) and 0.0 <= got["accuracy"] <= 1.0
    assert model.training  # put back as it was
    check = Evaluation(metric="perplexity", mode="min").check
    with pytest.raises(EvaluateError, match="accuracy.*not the target metric 'perplexity'"):
        check({"accuracy": 0.5})
    with pytest.raises(EvaluateError, match="returned float, not a dict"):
        check(0.5)
    with pytest.raises(EvaluateError, match="not a number"):
        check({"perplexity": "high"})


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "myevals.py").write_text(EVALS)
    return tmp_path


@pytest.mark.timeout(240)
def test_a_metric_to_minimise_drives_progress_summary_and_time_to_target(project):
    done = run_wavelet(
        "launch", *ONE_SHARD,
        "--evaluate", "myevals:loss_and_accuracy", "--target-metric", "test_loss",
        "--target-mode", "min", "--model", "mlp", "--epochs", "3", "--threads", "1",
        "--run-dir", "run", timeout=220, cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert summary["target_metric"] == "test_loss"
    assert summary["score"] == summary["metrics"]["test_loss"] < 2.2  # below chance's 2.30
    assert summary["test_accuracy"] == summary["metrics"]["accuracy"]
    assert "final test test_loss:" in done.stdout and "other test metrics: accuracy" in done.stdout
    figures = run_figures(project / "run", target=2.2)
    assert (figures.metric, figures.metric_mode) == ("test_loss", "min")
    assert figures.time_to_target_s is not None  # reached by going below it
    assert run_figures(project / "run", target=0.0).time_to_target_s is None


def test_an_evaluation_without_the_headline_is_refused_before_anything_starts(project):
    done = run_wavelet(
        "launch", "--evaluate", "myevals:loss_and_accuracy", "--target-metric", "perplexity",
        "--model", "mlp", "--epochs", "1", "--run-dir", "run", timeout=100, cwd=project,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "evaluation myevals:loss_and_accuracy returned" in done.stderr
    assert "set target_metric" in done.stderr and "before training" in done.stderr
    assert not (project / "run" / "logs").exists()  # no daemon started


@pytest.mark.timeout(240)
def test_an_evaluation_that_loses_its_headline_stops_the_job_with_one_line(project):
    done = run_wavelet(
        "launch", *ONE_SHARD,
        "--evaluate", "myevals:headline_for_a_few_samples", "--model", "mlp",
        "--epochs", "1", "--threads", "1", "--run-dir", "run", timeout=220, cwd=project,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:]
    assert "evaluation myevals:headline_for_a_few_samples returned" in done.stderr
    assert "set target_metric" in done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mode, devices", [("ps", "cpu"), ("allreduce", "cpu"), ("allreduce", "cpu,cpu")]
)
def test_copies_tested_after_training_resolve_time_to_target_finer_than_an_epoch(
    tmp_path, mode, devices
):
    run_dir = tmp_path / "run"
    done = run_wavelet(
        "launch", *ONE_SHARD,
        "--mode", mode, "--devices", devices, "--epochs", "2", "--eval-every-s", "0.01",
        "--run-dir", str(run_dir), timeout=110,
    )  # fmt: skip
    # two ranks: rank 1 ends while rank 0 still tests (its teardown: worker/allreduce.py,
    # exit_rank)
    assert done.returncode == 0, done.stderr[-2000:]
    evals = [
        r
        for p in (run_dir / "records").glob("worker-*.jsonl")
        for r in map(json.loads, p.read_text().splitlines())
        if r["kind"] == "eval"
    ]
    # every test is of a copy (none stalls training), the end of each epoch's among them
    assert all(r.get("timed") for r in evals)
    assert sorted(r["epoch"] for r in evals if r.get("epoch_end")) == [0, 1]
    assert {r["epoch"] for r in evals} == {0, 1}
    # tested after training, each stamped with the time its copy was taken, and how long the
    # test took beside it
    assert all(r["eval_s"] > 0 for r in evals)
    for p in (run_dir / "records").glob("worker-*.jsonl"):
        records = [json.loads(line) for line in p.read_text().splitlines()]
        ends = {r["epoch"]: r["t"] for r in records if r["kind"] == "epoch"}
        # each copy was taken during its epoch, by the one replica that tests
        assert all(r["t"] < ends[r["epoch"]] for r in records if r.get("timed"))
    figures = run_figures(run_dir, 0.5)
    assert len(figures.score_curve) == len(evals) + 1  # and the final test
