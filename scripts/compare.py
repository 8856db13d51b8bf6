"""``wavelet compare``: one job in several modes, one after another, side by side.

Modes: tick-tock on the PS, one wave per device, two waves started together (no baton),
bulk-synchronous PS, and all-reduce data parallel (one rank per device, or two). Writes
``report.md`` (one table, a row per mode), ``accuracy.png``, ``memory.png``, ``metrics.json`` and
each mode's full run directory with the raw records behind every number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import traceback
from pathlib import Path

from wavelet.common.config import JobConfig, LaunchConfig
from wavelet.common.metrics import RunMetrics, run_metrics
from wavelet.scripts.launch import launch
from wavelet.scripts.plots import accuracy_vs_time, memory_timelines

# name -> (description, launch settings, job settings); each is the same job otherwise
MODES: dict[str, tuple[str, dict, dict]] = {
    "ticktock": (
        "PS, 2 waves per device taking turns at forward (shared memory to co-located shards)",
        {"schedule": "ticktock"},
        {"waves": 2},
    ),
    "ticktock-tcp": (
        "PS, 2 waves tick-tock, tensors over TCP (ZeroMQ frames) even to co-located shards",
        {"schedule": "ticktock", "transport": "tcp"},
        {"waves": 2},
    ),
    "ticktock-wide": (
        "PS, 2 waves tick-tock, the worker's thread pool sized for one wave at a time",
        {"schedule": "ticktock", "threads": os.cpu_count() or 1},
        {"waves": 2},
    ),
    "single": ("PS, 1 wave per device", {"schedule": "ticktock"}, {"waves": 1}),
    "together": (
        "PS, 2 waves per device started together (no baton)",
        {"schedule": "together"},
        {"waves": 2},
    ),
    "procs": (
        "PS, 2 worker processes per device, 1 wave each (waves as processes, no baton)",
        {"schedule": "together", "processes_per_device": 2},
        {"waves": 1},
    ),
    "bsp": (
        "PS, 2 waves tick-tock, bulk-synchronous (s = 0)",
        {"schedule": "ticktock"},
        {"waves": 2, "staleness": 0},
    ),
    "allreduce": (
        "all-reduce DDP, 1 rank per device (batch x 2)",
        {"mode": "allreduce", "processes_per_device": 1},
        {"waves": 2},
    ),
    "allreduce2": (
        "all-reduce DDP, 2 ranks per device",
        {"mode": "allreduce", "processes_per_device": 2},
        {"waves": 2},
    ),
}


@dataclasses.dataclass
class ModeResult:
    name: str
    ok: bool
    metrics: RunMetrics | None = None
    error: str = ""


def compare(
    job: JobConfig,
    devices: list[str],
    modes: list[str],
    out: Path,
    target: float,
    settings: dict | None = None,
) -> list[ModeResult]:
    """Run ``job`` in each mode; ``settings`` are launch settings every mode shares (e.g. a
    CUDA memory cap)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in modes:
        _, launch_kw, job_kw = MODES[name]
        run_dir = out / name
        print(f"== {name}: {MODES[name][0]}", flush=True)
        try:
            config = LaunchConfig(
                job=dataclasses.replace(job, **job_kw),
                devices=devices,
                run_dir=str(run_dir),
                **{**(settings or {}), **launch_kw},
            )
            code = launch(config, quiet=True)
            if code != 0:
                results.append(
                    ModeResult(name, False, error=f"launch exited with {code}; see {run_dir}/logs")
                )
                continue
            results.append(ModeResult(name, True, run_metrics(run_dir, target)))
            print(f"   {results[-1].metrics.one_line()}", flush=True)
        except Exception as e:  # one broken mode must not lose the others' results
            (out / f"{name}.error.txt").write_text(traceback.format_exc())
            results.append(ModeResult(name, False, error=f"{type(e).__name__}: {e}"))
    write_report(results, out, target)
    return results


COLUMNS = [
    "mode",
    "samples/s",
    "time to {target} (s)",
    "final acc",
    "peak activations / device",
    "vs one wave",
    "wire KB / sample",
    "staleness mean / p99 per wave",
]


def table_rows(results: list[ModeResult], target: float) -> list[list[str]]:
    rows = []
    for r in results:
        if not r.ok or r.metrics is None:
            rows.append([r.name, "failed", r.error] + [""] * (len(COLUMNS) - 3))
            continue
        m = r.metrics
        worst = max(m.peak_bytes_per_device.values(), default=0)
        ratio = m.memory_ratio
        stale = ", ".join(f"{w} {s['mean']:.2f}/{s['p99']}" for w, s in m.staleness.items())
        rows.append(
            [
                r.name,
                f"{m.samples_per_s:.0f}",
                f"{m.time_to_target_s:.1f}" if m.time_to_target_s is not None else "not reached",
                f"{100 * m.final_accuracy:.2f}%" if m.final_accuracy is not None else "n/a",
                f"{worst / 1e6:.2f} MB",
                f"{ratio:.2f}x" if ratio is not None else "n/a",
                f"{m.wire_bytes_per_sample / 1e3:.1f}",
                stale or "n/a (no PS)",
            ]
        )
    return rows


def format_table(results: list[ModeResult], target: float) -> str:
    header = [c.format(target=f"{100 * target:g}%") for c in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results, target)]
    return "\n".join(lines)


def write_report(results: list[ModeResult], out: Path, target: float) -> None:
    ok = {r.name: r.metrics for r in results if r.ok and r.metrics}
    accuracy_vs_time(ok, out / "accuracy.png", target)
    memory_timelines(
        {n: m for n, m in ok.items() if n in ("ticktock", "together")}, out / "memory.png"
    )
    (out / "metrics.json").write_text(
        json.dumps(
            {r.name: (r.metrics.to_json() if r.metrics else {"error": r.error}) for r in results},
            indent=1,
        )
    )
    modes = "\n".join(f"- `{r.name}`: {MODES[r.name][0]}" for r in results)
    (out / "report.md").write_text(
        f"# wavelet compare\n\n{format_table(results, target)}\n\n{modes}\n\n"
        "Peak activations: saved-activation bytes of all waves (or ranks) of a device summed on "
        "one clock; *vs one wave*: that peak over the largest single wave's peak. Wire bytes: "
        "tensor bytes put on the network per training sample (PS: push and pull; all-reduce: "
        "what a ring all-reduce sends). Raw records: `<mode>/records/`; numbers: metrics.json.\n\n"
        "![accuracy](accuracy.png)\n\n![memory](memory.png)\n"
    )
