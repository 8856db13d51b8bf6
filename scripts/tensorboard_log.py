"""TensorBoard scalars for every run, written by the launcher from the run's records as it reads
them (so a long job can be watched live, and the scalars are the records' own numbers).

Tags: ``loss/<wave>``,
``step_time/<part>/<wave>`` (each part of a step the records time: ``STEP_PARTS``),
``activations/saved_bytes_peak/<wave>`` (x: the wave's iteration); ``staleness/mean/<wave>`` and
``staleness/p99/<wave>`` over windows of ``STALENESS_WINDOW`` pushes (x: the wave's clock);
``test_accuracy`` (x: epochs done), ``final_test_accuracy``; ``samples_per_s`` (all waves since the
start, as the progress line shows it; x: seconds since the start).
Waves are named as everywhere else (``w0/1``). ``wavelet compare`` and ``wavelet tune`` put each
run under one report folder: ``tensorboard --logdir REPORT_DIR`` overlays them.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from wavelet.common.figures import STEP_PARTS, quantile

STALENESS_WINDOW = 20  # pushes per wave (over all shards) per staleness point


class RunBoard:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))
        self._window: dict[str, list[int]] = defaultdict(list)

    def step(self, wave: str, r: dict) -> None:
        add, it, t = self.writer.add_scalar, r["iter"], r["t"]
        add(f"loss/{wave}", r["loss"], it, walltime=t)
        for name in STEP_PARTS:
            if name in r:
                add(f"step_time/{name}/{wave}", r[name], it, walltime=t)
        if "saved_bytes_peak" in r:
            add(f"activations/saved_bytes_peak/{wave}", r["saved_bytes_peak"], it, walltime=t)

    def throughput(self, samples_per_s: float, elapsed_s: float, t: float) -> None:
        """All waves' samples/s since the start, as the progress line shows it."""
        self.writer.add_scalar("samples_per_s", samples_per_s, round(elapsed_s, 3), walltime=t)

    def evaluation(self, epoch: int, metrics: dict[str, float], t: float) -> None:
        """Every test metric as ``test_<name>`` (``test_accuracy`` by default)."""
        for name, value in metrics.items():
            self.writer.add_scalar(f"test_{name}", value, epoch, walltime=t)

    def final(self, metric: str, value: float) -> None:
        """The job's final headline metric (the shards' weights, tested at the end)."""
        self.writer.add_scalar(f"final_test_{metric}", value, 0)

    def push(self, r: dict) -> None:
        """One shard push record: staleness points per window of pushes."""
        wave = r.get("wave_name") or f"{r['worker']}/{r['wave']}"
        window = self._window[wave]
        window.append(r["staleness"])
        if len(window) >= STALENESS_WINDOW:
            hist: dict[int, int] = defaultdict(int)
            for tau in window:
                hist[tau] += 1
            clock, t = r["clock"], r["t"]
            self.writer.add_scalar(f"staleness/mean/{wave}", sum(window) / len(window), clock, t)
            self.writer.add_scalar(f"staleness/p99/{wave}", quantile(hist, 0.99), clock, t)
            window.clear()

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
