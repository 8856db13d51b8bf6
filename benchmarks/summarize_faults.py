"""The tables of docs/performance.md ("Two emulated nodes") from the output of
``benchmarks/bench_faults.sh``: medians (ranges) over seeds, each against all-reduce in the
same scenario.

    python benchmarks/summarize_faults.py runs/bench-faults
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _results(out: Path, scenario: str) -> list[dict]:
    path = out / scenario / "results.json"
    return [r for r in json.loads(path.read_text()) if "error" not in r] if path.exists() else []


def _mr(values: list[float], digits: int) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mid = f"{statistics.median(values):.{digits}f}"
    return mid if len(values) == 1 else f"{mid} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _ratio(values: list[float], base: list[float]) -> str:
    values, base = [v for v in values if v is not None], [v for v in base if v is not None]
    if not values or not base:
        return "-"
    return f"{statistics.median(values) / statistics.median(base):.2f}x"


def table(rows: list[dict], extra=None) -> list[str]:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    base = [r for r in rows if r["mode"] == "allreduce"]
    lines = []
    for mode in modes:
        runs = [r for r in rows if r["mode"] == mode]
        sps = [r["samples_per_s"] for r in runs]
        ttt = [r["time_to_target_s"] for r in runs]
        reached = sum(t is not None for t in ttt)
        # what the mode learns per sample: samples trained by the time it reached the target
        samples = [r["samples_per_s"] * t for r, t in zip(runs, ttt, strict=True) if t is not None]
        cells = [
            mode,
            _mr(sps, 0),
            _ratio(sps, [r["samples_per_s"] for r in base]),
            _mr(ttt, 1) + ("" if reached == len(runs) else f"; reached {reached}/{len(runs)}"),
            _ratio(ttt, [r["time_to_target_s"] for r in base]),
            _mr(samples, 0),
        ]
        if extra:
            cells += extra(runs)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(out: Path) -> None:
    for scenario in ("equal", "slow", "noisy"):
        rows = _results(out, scenario)
        print(f"## {scenario}")

        def per_node(runs):
            seed0 = [r for r in runs if r["seed"] == 0]
            return [" / ".join(map(str, seed0[0]["samples_per_node"])) if seed0 else "-"]

        print("\n".join(table(rows, per_node if scenario == "slow" else None)))
        print()
    rows = _results(out, "leave-join")
    base = [r for r in rows if r["mode"] == "allreduce"]
    print("## leave-join")
    for mode in dict.fromkeys(r["mode"] for r in rows):
        runs = [r for r in rows if r["mode"] == mode]
        ttt = [r["time_to_target_s"] for r in runs]
        print(
            f"| {mode} | {_mr(ttt, 1)} | {_ratio(ttt, [r['time_to_target_s'] for r in base])} "
            f"| {_mr([r['samples_per_s'] for r in runs], 0)} "
            f"| {_mr([r['max_stall_s'] for r in runs], 2)} "
            f"| {_mr([r['join_first_push_s'] for r in runs], 2)} "
            f"| {', '.join(str(r.get('lost_updates')) for r in runs)} |"
        )
    print()
    for r in _results(out, "preempt"):
        print(
            f"preempt {r['mode']} seed {r['seed']}: codes {r['codes']}, longest stall of node 0 "
            f"{r['max_stall_s']:.2f} s, lost updates {r['lost_updates']}, final "
            f"{r['final_score']:.3f}, time to target {r['time_to_target_s']}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/bench-faults"))
