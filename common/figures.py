"""Numbers about a finished run, computed from its records (the raw JSON lines of the run dir).

Used by ``wavelet compare`` and ``wavelet tune``; every figure in their reports comes from here,
so a report can always be recomputed from the records it sits beside.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from wavelet.common.evaluation import format_value, reached
from wavelet.common.records import read_records

Trace = list[tuple[float, int]]  # (wall time, live saved-activation bytes), one point per change


def combined_timeline(traces: list[Trace]) -> Trace:
    """Sum of several step functions on one clock: at each change of any trace, the total of
    every trace's latest value (a trace counts 0 before its first point)."""
    events = sorted((t, i, b) for i, tr in enumerate(traces) for t, b in tr)
    current = [0] * len(traces)
    total = 0
    out: Trace = []
    for t, i, b in events:
        total += b - current[i]
        current[i] = b
        out.append((t, total))
    return out


def peak(trace: Trace) -> int:
    return max((b for _, b in trace), default=0)


def quantile(hist: dict[int, int], q: float) -> int:
    total = sum(hist.values())
    seen = 0
    for value in sorted(hist):
        seen += hist[value]
        if seen >= q * total:
            return value
    return 0


# What a step's time is made of, as the records name it (PS waves; all-reduce ranks)
STEP_PARTS = (
    "forward_s",
    "backward_s",
    "push_pull_s",
    "bound_wait_s",  # the part of push_pull_s that pulls were held at the shards
    "pull_wait_s",
    "baton_wait_s",
    "compute_wait_s",
    "backward_allreduce_s",
    "optimizer_s",
)


@dataclass
class RunFigures:
    run_dir: str
    samples_per_s: float = 0.0
    train_seconds: float = 0.0
    # the job's headline metric (common/evaluation.py): test accuracy unless it names another
    metric: str = "accuracy"
    metric_mode: str = "max"
    final_score: float | None = None
    time_to_target_s: float | None = None
    score_curve: list[tuple[float, float]] = field(default_factory=list)  # (s since start, value)
    peak_bytes_per_device: dict[str, int] = field(default_factory=dict)
    single_wave_peak_bytes: dict[str, int] = field(default_factory=dict)
    wire_bytes_per_sample: float = 0.0
    staleness: dict[str, dict] = field(default_factory=dict)  # wave -> mean, p99, hist, dropped
    bound_wait_s: float = 0.0
    step_means: dict[str, float] = field(default_factory=dict)  # seconds per step, by part
    memory_traces: dict[str, dict[str, Trace]] = field(default_factory=dict)  # device -> wave

    @property
    def memory_ratio(self) -> float | None:
        """Combined peak over one wave's peak, worst device."""
        ratios = [
            self.peak_bytes_per_device[d] / self.single_wave_peak_bytes[d]
            for d in self.peak_bytes_per_device
            if self.single_wave_peak_bytes.get(d)
        ]
        return max(ratios) if ratios else None

    @property
    def final_text(self) -> str:
        return format_value(self.metric, self.final_score)

    def one_line(self) -> str:
        return f"final {self.metric} {self.final_text}, {self.samples_per_s:.0f} samples/s"

    def to_json(self) -> dict:
        d = asdict(self)
        d["memory_ratio"] = self.memory_ratio
        return d


def run_figures(run_dir: str | Path, target: float) -> RunFigures:
    """What a run dir's records say: throughput, the headline metric over time and time to
    ``target`` of it (in the direction the job's ``target_mode`` says), memory, staleness."""
    run_dir = Path(run_dir)
    m = RunFigures(str(run_dir))
    job_file = run_dir / "job.json"
    if job_file.exists():
        job = json.loads(job_file.read_text())
        m.metric = job.get("target_metric", "accuracy")
        m.metric_mode = job.get("target_mode", "max")
    start = None
    last_t = None
    samples = 0
    wire = 0
    devices: dict[str, str] = {}
    traces: dict[str, dict[str, Trace]] = defaultdict(dict)
    evals: list[tuple[float, float]] = []
    parts: dict[str, list[float]] = defaultdict(list)
    for path in sorted((run_dir / "records").glob("worker-*.jsonl")):
        wave = path.stem.replace("worker-", "w").replace("-wave-", "/")
        for r in read_records(path):
            kind = r["kind"]
            if kind == "start":
                start = r["t"] if start is None else min(start, r["t"])
                devices[wave] = str(r.get("device_index", 0))
            elif kind == "step":
                samples += r["samples"]
                wire += r.get("wire_bytes", 0)
                for part in STEP_PARTS:
                    if part in r:
                        parts[part].append(r[part])
                m.bound_wait_s += r.get("bound_wait_s", 0.0)
                last_t = r["t"] if last_t is None else max(last_t, r["t"])
            elif kind == "eval":
                evals.append((r["t"], r.get("score", r.get("test_acc"))))
            elif kind == "memory_trace":
                traces[devices.get(wave, "0")][wave] = [tuple(p) for p in r["trace"]]
    if start is None or last_t is None:
        return m
    m.step_means = {k: sum(v) / len(v) for k, v in parts.items()}
    m.train_seconds = last_t - start
    m.samples_per_s = samples / m.train_seconds if m.train_seconds > 0 else 0.0
    m.wire_bytes_per_sample = wire / samples if samples else 0.0
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        m.final_score = summary.get("score", summary.get("test_accuracy"))
        if m.final_score is not None:
            evals.append((last_t, m.final_score))
    m.score_curve = sorted((t - start, a) for t, a in evals)
    m.time_to_target_s = next(
        (t for t, v in m.score_curve if v is not None and reached(v, target, m.metric_mode)), None
    )
    for device, by_wave in traces.items():
        m.memory_traces[device] = by_wave
        m.peak_bytes_per_device[device] = peak(combined_timeline(list(by_wave.values())))
        m.single_wave_peak_bytes[device] = max(peak(t) for t in by_wave.values())
    m.staleness = push_staleness(run_dir)
    return m


def push_staleness(run_dir: Path) -> dict[str, dict]:
    """Per wave, over all shards' push records: staleness histogram, mean, p99, dropped."""
    hist: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    dropped: dict[str, int] = defaultdict(int)
    for path in sorted((run_dir / "records").glob("ps-*-pushes.jsonl")):
        for r in read_records(path):
            wave = f"{r['worker']}/{r['wave']}"
            hist[wave][r["staleness"]] += 1
            dropped[wave] += r["action"] == "dropped"
    out = {}
    for wave, h in sorted(hist.items()):
        total = sum(h.values())
        out[wave] = {
            "mean": sum(t * n for t, n in h.items()) / total,
            "p99": quantile(h, 0.99),
            "max": max(h),
            "hist": {str(t): n for t, n in sorted(h.items())},
            "dropped": dropped[wave],
        }
    return out
