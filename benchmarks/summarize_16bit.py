"""The table of ``benchmarks/bench_16bit.sh``: per job and mode, each variant's final test
accuracy (median over seeds, and the spread: lowest to highest), and its median difference
from fp32 over the same seeds, in percentage points.

    python benchmarks/summarize_16bit.py runs/bench-16bit
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

RUN = re.compile(r"(?P<job>\w+)-(?P<mode>ps|allreduce)-(?P<variant>[\w-]+)-seed(?P<seed>\d+)$")


def main(out: Path) -> None:
    acc: dict[tuple[str, str, str], dict[int, float]] = defaultdict(dict)
    rate: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for summary in sorted(out.glob("*/summary.json")):
        m = RUN.match(summary.parent.name)
        if not m:
            continue
        s = json.loads(summary.read_text())
        key = (m["job"], m["mode"], m["variant"])
        acc[key][int(m["seed"])] = 100 * s["test_accuracy"]
        rate[key].append(s["samples_per_s"])
    print(
        "| job | mode | variant | seeds | test acc % (median, min-max) | vs fp32 (points) "
        "| samples/s vs fp32 |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for key in sorted(acc, key=lambda k: (k[0], k[1], k[2] != "fp32", k[2])):
        job, mode, variant = key
        got = acc[key]
        base = acc.get((job, mode, "fp32"), {})
        diffs = [got[s] - base[s] for s in got if s in base]
        vals = list(got.values())
        base_rate = statistics.median(rate[(job, mode, "fp32")]) if base else 0.0
        print(
            f"| {job} | {mode} | {variant} | {len(vals)} | {statistics.median(vals):.1f} "
            f"({min(vals):.1f}-{max(vals):.1f}) | "
            f"{statistics.median(diffs):+.1f} | "
            f"{statistics.median(rate[key]) / base_rate:.2f}x |"
            if diffs and base_rate
            else f"| {job} | {mode} | {variant} | {len(vals)} | {statistics.median(vals):.1f} "
            f"({min(vals):.1f}-{max(vals):.1f}) | - | - |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/bench-16bit"))
