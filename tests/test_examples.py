"""The examples in examples/ run as their docstrings say and learn: the regression's R^2 and the
transformer language model's perplexity under tick-tock, one wave and all-reduce in one
``wavelet compare``."""

import json
from pathlib import Path

import pytest
from conftest import ONE_SHARD, run_wavelet

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_regression_example_learns(tmp_path):
    done = run_wavelet(
        "launch", "--dataset", "examples.regression:dataset",
        "--model", "examples.regression:model", "--step", "examples.regression:mse_step",
        "--evaluate", "examples.regression:r_squared", "--target-metric", "r2",
        "--optimizer", "adam", "--lr", "0.003", "--epochs", "4", "--threads", "1", *ONE_SHARD,
        "--run-dir", str(tmp_path / "run"), timeout=220, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["target_metric"] == "r2" and summary["score"] > 0.8, summary["metrics"]
    assert "final test r2:" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_language_model_example_learns_in_every_kind_of_mode(tmp_path):
    out = tmp_path / "cmp"
    modes = ["ticktock", "allreduce"]  # the parameter server's waves, and all-reduce
    done = run_wavelet(
        "compare", "--dataset", "examples.tiny_lm:dataset", "--model", "examples.tiny_lm:model",
        "--step", "examples.tiny_lm:next_token_step", "--evaluate", "examples.tiny_lm:perplexity",
        "--target-metric", "perplexity", "--target-mode", "min", "--optimizer", "adamw",
        "--lr", "0.002", "--batch-size", "16", "--epochs", "1", *ONE_SHARD,
        "--set", "dataset_kwargs.max_bytes=120000", "--target-acc", "64",
        "--modes", ",".join(modes), "--out", str(out), timeout=290, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    for mode in modes:
        m = metrics[mode]
        assert m["metric"] == "perplexity", m
        # a model that knows nothing scores 256 (bytes); a quarter of that after one epoch
        assert m["final_score"] < 64, (mode, m["final_score"])
        assert m["time_to_target_s"] is not None  # reached by going below the target
    report = (out / "report.md").read_text()
    assert "time to perplexity 64 (s)" in report and "final perplexity" in report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchvision_resnet18_learns_an_image_folder_through_loader_workers(tmp_path):
    pytest.importorskip("torchvision", reason="the vision example needs wavelet[vision]")
    done = run_wavelet(
        "launch", "--model", "torchvision.models:resnet18", "--set", "model_kwargs.num_classes=4",
        "--dataset", "examples.vision:image_folder",
        "--set", f"dataset_kwargs.root={tmp_path / 'images'}", "--set", "loader_workers=1",
        "--batch-size", "16", "--lr", "0.02", "--epochs", "2", "--threads", "1",
        "--run-dir", str(tmp_path / "run"), timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.5, summary  # chance is 0.25 on four classes
    assert len(list((tmp_path / "images" / "train").glob("*/*.png"))) == 4 * 96
