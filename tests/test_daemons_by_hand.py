"""Daemons started by hand, as the README's "Several machines" shows: a worker reports its own
progress and summary, and leaves the user's shards serving."""

import json

import pytest
from conftest import run_wavelet
from helpers import record_samples

from wavelet.scripts.stats import fetch_stats

JOB = ["--epochs", "3"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_started_by_hand_reports_its_run_and_leaves_the_shards_serving(
    tmp_path, shard_daemons
):
    daemons = shard_daemons(JOB, count=2, expect_waves=2, by_hand=True)
    run_dir = tmp_path / "worker"
    shards = [arg for a in daemons.addresses for arg in ("--shard", a)]
    done = run_wavelet(
        "worker", *JOB, "--threads", "1", "--run-dir", str(run_dir), *shards, timeout=150,
        by_hand=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert f"records in {run_dir / 'records'}" in out
    # no logs (its output is the user's); the shards' weights as the trained model
    assert f"records, the trained model (model.pt) and summary.json: {run_dir}" in out
    assert "final test accuracy: " in out and "samples/s" in out, out
    assert "staleness per wave" in out and "w0/0" in out and "w0/1" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples"] == record_samples(run_dir) > 0  # all of this run's steps
    assert summary["score"] == summary["test_accuracy"] > 0.5
    assert f"{100 * summary['score']:.2f}%" in out
    # the shards are the user's: still running, still answering, with the waves' updates
    assert all(p.poll() is None for p in daemons.procs)
    stats = fetch_stats(daemons.addresses)
    assert all(s["version"] > 0 for s in stats), stats


@pytest.mark.timeout(120)
def test_a_worker_asked_not_to_report_prints_nothing_of_the_run(tmp_path, shard_daemons):
    daemons = shard_daemons(["--epochs", "1"], count=1, expect_waves=2)
    done = run_wavelet(
        "worker",
        "--epochs",
        "1",
        "--shards",
        "1",
        "--threads",
        "1",
        "--no-report",
        "--run-dir",
        str(tmp_path / "w"),
        "--shard",
        daemons.addresses[0],
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "", done.stdout  # wavelet launch's workers: the launcher reports
    assert not (tmp_path / "w" / "summary.json").exists()
