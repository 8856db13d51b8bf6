"""How close a mode came to what a rule that wasted nothing could reach, from runs of
``benchmarks/cluster.py`` with a cap (``--slow`` or ``--noisy``).

The ideal rule keeps every node computing at the share of its core the cap leaves it, at
all-reduce's pace per node where nodes are free, and learns from a sample what all-reduce does.
For each seed it trains the samples all-reduce needed to reach the target (all-reduce's own
records), starting when all-reduce's first step did, under the run's cap schedule; its time to
the target against all-reduce's measured one is the best ratio any rule could show in that seed.

    python benchmarks/ideal_bound.py /tmp/noisy
    python benchmarks/ideal_bound.py /tmp/slow --equal /tmp/equal
    python benchmarks/ideal_bound.py /tmp/equal --samples      # each run's samples to target

Several folders are read one by one, a table each (``--equal`` serves them all).

A free node's pace is all-reduce's in the runs' free periods; a steady cap leaves none, so an
equal-nodes run of the same hour (``--equal``) gives it there.

Read with the issue's targets: where the ideal ratio is near a target, only the noise between
runs meets it (docs/stragglers.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cap_response import step_times  # benchmarks/, beside this script

from wavelet.common.records import read_records

SETTLE_S = 1.0  # after a cap comes or goes, all-reduce's pace is not yet the new one


def caps(result: dict) -> list[tuple[int, float, float, float]]:
    """(node, start, end, pct) of every cap of the run."""
    return [tuple(c) for c in result.get("timeline", {}).get("caps", [])]


def share(t: float, nodes: int, run_caps) -> float:
    """The nodes' cores a cap leaves free at wall time ``t``, in nodes."""
    left = [1.0] * nodes
    for node, start, end, pct in run_caps:
        if start <= t < end:
            left[node] = min(left[node], pct / 100)
    return sum(left)


def free_pace(result: dict, nodes: int) -> float | None:
    """All-reduce's samples/s per node while no node was capped (from ``SETTLE_S`` after a cap
    went to the next one), or None where no such time was trained."""
    times = sorted(step_times(result))
    if not times:
        return None
    run_caps = caps(result)
    begin, end = times[0][0], times[-1][0]
    edges = sorted({begin, end} | {x for c in run_caps for x in c[1:3] if begin < x < end})
    samples = seconds = 0.0
    for a, b in zip(edges, edges[1:], strict=False):
        if share((a + b) / 2, nodes, run_caps) < nodes:
            continue
        a += SETTLE_S if a != begin else 0.0
        if b > a:
            samples += sum(n for t, n in times if a <= t < b)
            seconds += b - a
    return samples / seconds / nodes if seconds else None


def start_and_target(
    result: dict, target: float, times: list[tuple[float, int]] | None = None
) -> tuple[float, float | None, int | None]:
    """The run's start (its first ``start`` record), when a test first reached ``target``, and
    the samples every node had trained by then (of ``times``, its steps, where read already)."""
    starts, evals = [], []
    for path in Path(result["run_dir"]).glob("node*/records/worker-*.jsonl"):
        for r in read_records(path):
            if r.get("kind") == "start":
                starts.append(r["t"])
            elif r.get("kind") == "eval" and r.get("score") is not None:
                evals.append((r["t"], r["score"]))
    reached = sorted(t for t, score in evals if score >= target)
    if not starts or not reached:
        return min(starts, default=0.0), None, None
    t = reached[0]
    times = step_times(result) if times is None else times
    return min(starts), t, sum(n for ts, n in times if ts <= t)


def ideal_time(
    result: dict, first: float, samples: int, pace: float, nodes: int, step_s: float = 0.01
):
    """Seconds from all-reduce's first step (at ``first``) until the ideal rule trained
    ``samples`` under the run's caps."""
    run_caps, t, done = caps(result), first, 0.0
    while done < samples:
        done += pace * share(t, nodes, run_caps) * step_s
        t += step_s
    return t - first


def bounds(results: list[dict], equal: list[dict], target: float, nodes: int) -> list[dict]:
    """Per seed: all-reduce's time to the target, the ideal rule's, and each other mode's."""
    if not any(r["mode"] == "allreduce" and "error" not in r for r in results):
        raise SystemExit(
            "no all-reduce run in these runs: run cluster.py with --modes ...,allreduce"
        )

    def paces_of(runs):
        return [p for r in runs if r["mode"] == "allreduce" and (p := free_pace(r, nodes))]

    # the run's own free periods where it has some; a steady cap leaves none: the equal run's
    paces = paces_of(results) or paces_of(equal)
    if not paces:
        raise SystemExit("no all-reduce run trained while every node was free: give --equal RUN")
    pace = statistics.median(paces)
    rows = []
    for ar in (r for r in results if r["mode"] == "allreduce" and "error" not in r):
        times = step_times(ar)  # its records, read once
        start, reached, samples = start_and_target(ar, target, times)
        if reached is None:
            continue  # all-reduce never reached it: no sample count to hold the ideal to
        first = min(t for t, _ in times)
        best = (first - start) + ideal_time(ar, first, samples, pace, nodes)
        row = dict(seed=ar["seed"], samples=samples, allreduce=reached - start, ideal=best)
        for r in results:
            if r["seed"] == ar["seed"] and r["mode"] != "allreduce" and "error" not in r:
                # its time as cluster.py measured it, and the samples it needed
                row[r["mode"]] = (r["time_to_target_s"], start_and_target(r, target)[2])
        rows.append(row)
    return rows, pace


def table(rows: list[dict], pace: float, target: float) -> str:
    modes = sorted({k for r in rows for k in r} - {"seed", "samples", "allreduce", "ideal"})
    head = ["seed", "all-reduce's samples to target", "all-reduce, s", "ideal, s", "ideal ratio"]
    for m in modes:
        head += [f"{m}, s", f"{m} ratio", f"{m}'s samples to target"]
    lines = [
        f"A free node's pace: {pace:.0f} samples/s (all-reduce, per node); target {target:g}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [str(r["seed"]), str(r["samples"]), f"{r['allreduce']:.1f}", f"{r['ideal']:.1f}"]
        cells.append(f"{r['ideal'] / r['allreduce']:.2f}x")
        for m in modes:
            t, samples = r.get(m, (None, None))
            ratio = "-" if t is None else f"{t / r['allreduce']:.2f}x"
            cells += ["not reached" if t is None else f"{t:.1f}", ratio, str(samples or "-")]
        lines.append("| " + " | ".join(cells) + " |")
    if rows:
        ratio = statistics.median(r["ideal"] / r["allreduce"] for r in rows)
        lines += ["", f"Median ideal ratio: {ratio:.2f}x all-reduce's time to the target."]
    return "\n".join(lines)


def samples_table(results: list[dict], target: float) -> str:
    """Every run's time to the target and the samples all its nodes had trained by then
    (``--samples``: runs with or without all-reduce)."""
    lines = ["| mode | seed | time to target, s | samples to target |", "|---|---|---:|---:|"]
    for r in sorted(results, key=lambda r: (r["mode"], r["seed"])):
        if "error" in r:
            continue
        t, samples = r.get("time_to_target_s"), start_and_target(r, target)[2]
        when = "not reached" if t is None else f"{t:.1f}"
        lines.append(f"| {r['mode']} | {r['seed']} | {when} | {samples or '-'} |")
    return "\n".join(lines)


def load(folder: str, p: argparse.ArgumentParser) -> list[dict]:
    path = Path(folder) / "results.json"
    if not path.exists():
        p.error(f"{path} not found: give the --out folder of a cluster.py run")
    return json.loads(path.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="--out folders of cluster.py runs with a cap")
    p.add_argument("--equal", default="", help="the --out folder of an equal-nodes run")
    p.add_argument("--target-acc", type=float, default=0.6)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--samples", action="store_true", help="only each run's samples to the target")
    args = p.parse_args(argv)
    equal = load(args.equal, p) if args.equal else []
    # each folder on its own: its seeds are other runs than another folder's of the same seed
    for i, folder in enumerate(args.runs):
        results = load(folder, p)
        if len(args.runs) > 1:
            print(("\n" if i else "") + f"## {folder}\n")
        if args.samples:
            print(samples_table(results, args.target_acc))
            continue
        rows, pace = bounds(results, equal, args.target_acc, args.nodes)
        if not rows:
            raise SystemExit(
                f"{folder}: all-reduce reached {args.target_acc:g} in no seed: nothing to hold "
                "the ideal to"
            )
        print(table(rows, pace, args.target_acc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
