"""Prometheus metrics from live daemons and TensorBoard scalars from every run, checked against
the shards' own statistics and the run's JSON records."""

import json
import urllib.request

import pytest
from conftest import ONE_SHARD, forked, run_wavelet, wait_for
from prometheus_client.parser import text_string_to_metric_families

from wavelet.common.protocol import Op
from wavelet.common.records import read_records
from wavelet.worker.connection import call_shard


def _total(scraped: dict, name: str) -> float:
    return sum(scraped.get(name, {}).values())


def _scrape(url: str) -> dict[str, dict[tuple, float]]:
    """name -> {sorted label items: value}, for every sample of the page at ``url``."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_live_metrics_rise_and_agree_with_the_shard(tmp_path):
    run_dir = tmp_path / "run"
    args = ["launch", "--run-dir", str(run_dir), "--epochs", "60", "--metrics-port", "0"]
    with forked(args, tmp_path / "launch.log") as launcher:
        urls = run_dir / "metrics"
        wait_for(lambda: len(list(urls.glob("*.url"))) == 3, 60, "daemons did not serve metrics")
        shard_url = (urls / "ps-0.url").read_text().strip()
        worker_url = (urls / "worker-0.url").read_text().strip()
        assert shard_url.startswith("http://127.0.0.1:")  # binds like the shard: loopback
        address = (run_dir / "ps-0.addr").read_text().strip()
        shard0 = (("shard", "0"),)
        updates = "wavelet_shard_updates_total"
        # registered waves show 0 pushes at first: wait until both counters really moved
        wait_for(
            lambda: (
                _total(_scrape(shard_url), "wavelet_shard_pushes_total") > 0
                and _scrape(shard_url).get(updates, {}).get(shard0, 0) > 0
            ),
            120,
            "no pushes yet",
        )
        before = call_shard(address, Op.STATS).body["waves"]
        first = _scrape(shard_url)
        after = call_shard(address, Op.STATS).body["waves"]
        for labels, count in first["wavelet_shard_staleness_count"].items():
            wave = dict(labels)["wave"]
            assert first["wavelet_shard_pushes_total"][labels] == count
            assert before[wave]["pushes"] <= count <= after[wave]["pushes"]
            buckets = {
                dict(k)["le"]: v
                for k, v in first["wavelet_shard_staleness_bucket"].items()
                if dict(k)["wave"] == wave
            }
            assert buckets["+Inf"] == count
        assert first[updates][shard0] > 0
        # the membership: both waves joined, none left yet; the epoch counts the changes
        assert first["wavelet_shard_joins_total"][shard0] == 2
        assert first["wavelet_shard_leaves_total"][shard0] == 0
        assert first["wavelet_shard_membership_epoch"][shard0] == 2

        def risen(url, name, then) -> bool:
            now = _scrape(url)[name]
            return all(now[labels] > value for labels, value in then[name].items())

        wait_for(
            lambda: (
                risen(shard_url, "wavelet_shard_pushes_total", first)
                and risen(shard_url, updates, first)
            ),
            60,
            "pushes and updates did not rise",
        )

        def waves_on(url) -> set[str]:
            page = _scrape(url).get("wavelet_worker_samples_total", {})
            return {dict(labels)["wave"] for labels in page}

        # a wave's series appears with its first step record, written after its reply: on a
        # loaded machine the other wave may push again before that record (CI saw only w0/0)
        wait_for(lambda: waves_on(worker_url) == {"w0/0", "w0/1"}, 60, "a wave has no series")
        w1 = _scrape(worker_url)
        wait_for(
            lambda: risen(worker_url, "wavelet_worker_samples_total", w1),
            60,
            "the worker's samples did not rise",
        )
        w2 = _scrape(worker_url)
        assert w2["wavelet_worker_forward_seconds_total"]
        # wavelet stats finds the shards from the run dir
        done = run_wavelet("stats", str(run_dir), timeout=60)
        assert done.returncode == 0, done.stderr
        assert "w0/0" in done.stdout and "shm" in done.stdout
        assert "version" in done.stdout and ", wave turns," in done.stdout  # the default on a CPU
        launcher.send_signal(2)
        launcher.wait(30)


@pytest.mark.timeout(120)
def test_tensorboard_scalars_match_the_records(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    done = run_wavelet(
        "launch", *ONE_SHARD, "--run-dir", str(run_dir), "--epochs", "3", timeout=110
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (run_dir / "metrics").exists()  # metrics are off unless asked for
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for wave in (0, 1):
        steps = [
            r
            for r in read_records(run_dir / "records" / f"worker-0-wave-{wave}.jsonl")
            if r["kind"] == "step"
        ]
        losses = events.Scalars(f"loss/w0/{wave}")
        assert [e.step for e in losses] == [r["iter"] for r in steps]
        for e, r in zip(losses, steps, strict=True):
            assert e.value == pytest.approx(r["loss"], rel=1e-6)
        forward = events.Scalars(f"step_time/forward_s/w0/{wave}")
        assert len(forward) == len(steps)
        assert f"activations/saved_bytes_peak/w0/{wave}" in tags
        assert f"staleness/mean/w0/{wave}" in tags and f"staleness/p99/w0/{wave}" in tags
    evals = [
        r
        for r in read_records(run_dir / "records" / "worker-0-wave-0.jsonl")
        if r["kind"] == "eval"
    ]
    accuracy = events.Scalars("test_accuracy")
    assert [e.value for e in accuracy] == pytest.approx([r["test_acc"] for r in evals])
    summary = json.loads((run_dir / "summary.json").read_text())
    final = events.Scalars("final_test_accuracy")
    assert final[0].value == pytest.approx(summary["test_accuracy"])
    assert events.Scalars("samples_per_s")
