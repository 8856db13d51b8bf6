"""The table of benchmarks/bench_updates.sh: per device count and update rule, the median time to
the target over seeds (with its range and how many seeds reached it), samples/s, final accuracy,
samples seen to the target and mean staleness, from each run's metrics.json.

Usage: python benchmarks/summarize_updates.py runs/bench-updates
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def _staleness(figures: dict) -> float | None:
    waves = figures.get("staleness") or {}
    means = [w["mean"] for w in waves.values()]
    return statistics.mean(means) if means else None


def rows(root: Path) -> dict[tuple[str, str], list[dict]]:
    runs: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for metrics in sorted(root.glob("*/metrics.json")):
        match = re.fullmatch(r"(.+)-seed(\d+)-(.+)", metrics.parent.name)
        if not match:
            continue
        devices, _, variant = match.groups()
        for mode, figures in json.loads(metrics.read_text()).items():
            name = mode if mode.startswith("allreduce") else f"{mode} ({variant})"
            runs[devices, name].append(figures)
    return runs


def median_range(values: list[float], digits: int = 1) -> str:
    """The median and, over more than one value, the range: ``12.9 (10.6-15.2)``."""
    if not values:
        return "-"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.{digits}f}"
    return f"{mid:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(root: Path) -> str:
    lines = [
        "| devices | mode (variant) | time to target, s: median (range) | reached | samples/s "
        "| samples to target | final acc | mean staleness |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (devices, name), runs in sorted(rows(root).items()):
        reached = [r["time_to_target_s"] for r in runs if r.get("time_to_target_s") is not None]
        samples = [
            r["time_to_target_s"] * r["samples_per_s"]
            for r in runs
            if r.get("time_to_target_s") is not None
        ]
        stale = [s for r in runs if (s := _staleness(r)) is not None]
        lines.append(
            f"| {devices} | {name} | {median_range(reached)} | {len(reached)}/{len(runs)} "
            f"| {median_range([r['samples_per_s'] for r in runs], 0)} | {median_range(samples, 0)} "
            f"| {median_range([100 * (r.get('final_score') or 0) for r in runs])}% "
            f"| {median_range(stale, 2)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/bench-updates")))
