"""Benchmark: what serving Prometheus metrics costs a job's samples/s.

Runs the same job (the default one unless told otherwise) alternately without metrics and with
``--metrics-port 0`` while a scraper reads every daemon's /metrics once a second (Prometheus
scrapes every 15 s by default: this is the harsher case), and reports the median samples/s of
each and their ratio. Run: ``python benchmarks/bench_metrics.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def _scrape_until(done: threading.Event, run_dir: Path) -> int:
    scrapes = 0
    while not done.wait(1.0):
        for url_file in (run_dir / "metrics").glob("*.url"):
            try:
                urllib.request.urlopen(url_file.read_text().strip(), timeout=2).read()
                scrapes += 1
            except OSError:
                pass  # a daemon that just stopped
    return scrapes


def run_job(run_dir: Path, metrics: bool, extra: list[str]) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "wavelet.scripts.cli", "launch", "--quiet", "--run-dir"]
    cmd += [str(run_dir), *extra] + (["--metrics-port", "0"] if metrics else [])
    done = threading.Event()
    scrapes: list[int] = []
    scraper = threading.Thread(target=lambda: scrapes.append(_scrape_until(done, run_dir)))
    if metrics:
        scraper.start()
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    finally:
        done.set()
        if metrics:
            scraper.join()
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["samples_per_s"], (scrapes[0] if scrapes else 0)


def component_costs(repeats: int = 2000) -> tuple[float, float]:
    """Seconds one worker step record costs the metrics, and one scrape of a shard's (4 waves)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from wavelet.common.config import JobConfig
    from wavelet.common.daemon_config import PSConfig
    from wavelet.ps.metrics import ShardCollector
    from wavelet.ps.service import ShardService
    from wavelet.ps.staleness import WaveStats
    from wavelet.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics("w0")
    step = {"samples": 32, "loss": 1.0, "t": 0.0, "saved_bytes_peak": 1, "forward_s": 0.001}
    start = time.perf_counter()
    for i in range(repeats):
        step["t"] = float(i)
        metrics.record("w0/0", step)
    per_record = (time.perf_counter() - start) / repeats
    service = ShardService(PSConfig(job=JobConfig(shards=1)))
    for w in range(4):
        stats = service.stats.setdefault((f"w{w}", 0), WaveStats())
        for tau in range(5):
            stats.record_push(tau)
    registry = CollectorRegistry()
    registry.register(ShardCollector(service))
    start = time.perf_counter()
    for _ in range(repeats // 10):
        generate_latest(registry)
    return per_record, (time.perf_counter() - start) / (repeats // 10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=4, help="runs of each, alternating")
    p.add_argument("job", nargs="*", help="job flags for wavelet launch, e.g. --epochs 30")
    args = p.parse_args(argv)
    rates: dict[bool, list[float]] = {False: [], True: []}
    scrapes = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for metrics in (False, True):
                rate, n = run_job(Path(tmp) / f"{i}-{metrics}", metrics, args.job)
                rates[metrics].append(rate)
                scrapes += n
                print(
                    f"run {i + 1}, metrics {'on' if metrics else 'off'}: {rate:.0f} samples/s",
                    file=sys.stderr,
                    flush=True,
                )
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print("\n| metrics | median samples/s | vs off |\n|---|---:|---:|")
    print(f"| off | {off:.0f} | 1.000x |")
    print(f"| on, scraped every second ({scrapes} scrapes) | {on:.0f} | {on / off:.3f}x |")
    print(f"\n{args.repeats} runs each, alternating: {rates}")
    record_s, scrape_s = component_costs()
    print(
        f"\nparts: a worker's step record costs {1e6 * record_s:.1f} us of metrics; a scrape of a "
        f"shard's metrics (4 waves) {1e3 * scrape_s:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
