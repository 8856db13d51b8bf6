"""Where a synchronous turn's time goes, from the records of a run of ``benchmarks/cluster.py``
(``RUN/merged/records``): per node, the share of the wall clock its waves spent in forward or
backward, how long its push waited per turn for the last push of the same turn (a group's
pushes for one clock, as each shard received them; every shard's turns count), and the
hand-over: from the push that made the weights a step read (the last of its turn; the latest
over the shards) to that step's forward, which is the update, the weights' way back and the
wave's start, none of it hidden under compute in wave turns.

    python benchmarks/turn_waits.py /tmp/slow/1gbit/ticktock/seed0 [more run folders]

Under wave turns a node that pushes first waits for the last; where both nodes wait about as
often, the lateness is noise no batch size can foresee (docs/stragglers.md).
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

from wavelet.common.records import read_records

SKIP_STEPS = 5  # each wave's first steps: allocation and the first balancing


def turn_waits(records: Path) -> dict[str, list[float]]:
    """Per worker, what each of its pushes waited for the last push of its turn, in seconds."""
    waits: dict[str, list[float]] = defaultdict(list)
    for log in sorted(records.glob("ps-*-pushes.jsonl")):
        turns: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
        for r in read_records(log):
            if "clock" in r and "worker" in r and r.get("action") != "folded":
                turns[r["wave"], r["clock"]][r["worker"]] = r["t"]
        workers = {w for pushes in turns.values() for w in pushes}
        for pushes in turns.values():
            if len(pushes) == len(workers) > 1:  # a turn every worker pushed to this shard
                last = max(pushes.values())
                for worker, t in pushes.items():
                    waits[worker].append(last - t)
    return dict(waits)


def _shard_of(log: Path) -> int:
    return int(re.match(r"ps-(\d+)-", log.name).group(1))  # a standby's log: its shard's


def hand_overs(records: Path) -> dict[str, list[float]]:
    """Per worker (``w<rank>``), from the push that made the version each step read (on every
    shard; the latest of them) to the step's forward, in seconds. A push at a shard's version v
    is in the update that makes v + 1 (asynchronous: it is that update; synchronous: the last
    push of the turn closes it), so the version v + 1 was made by the latest push at v."""
    made: dict[tuple[int, int], float] = {}  # (shard, version) -> when the push that made it came
    for log in sorted(records.glob("ps-*-pushes.jsonl")):
        shard = _shard_of(log)
        for r in read_records(log):
            if "version" in r and "t" in r:
                key = (shard, r["version"] + 1)
                made[key] = max(made.get(key, r["t"]), r["t"])
    out: dict[str, list[float]] = defaultdict(list)
    for log in sorted(records.glob("worker-*-wave-*.jsonl")):
        rank = re.match(r"worker-(\d+)-wave-", log.name).group(1)
        steps = [r for r in read_records(log) if r.get("kind") == "step"][SKIP_STEPS:]
        for r in steps:
            times = [made.get((i, v)) for i, v in enumerate(r.get("versions_read", []))]
            if times and None not in times and "t_forward_start" in r:
                out[f"w{rank}"].append(r["t_forward_start"] - max(times))
    return dict(out)


def compute_share(records: Path) -> dict[str, float]:
    """Per worker (``w<rank>``), its waves' forward and backward seconds over the wall clock
    their steps spanned (after each wave's first ``SKIP_STEPS``), summed over its waves."""
    share: dict[str, float] = defaultdict(float)
    for log in sorted(records.glob("worker-*-wave-*.jsonl")):
        rank = re.match(r"worker-(\d+)-wave-", log.name).group(1)
        steps = [r for r in read_records(log) if r.get("kind") == "step"][SKIP_STEPS:]
        if len(steps) < 2:
            continue
        wall = steps[-1]["t"] - steps[0]["t"]
        busy = sum(r["forward_s"] + r["backward_s"] for r in steps[1:])
        share[f"w{rank}"] += busy / wall
    return dict(share)


def table(run: Path) -> str:
    records = run / "merged" / "records"
    if not records.is_dir():
        raise SystemExit(f"{records} is missing: give a run folder of benchmarks/cluster.py")
    waits, share, hand = turn_waits(records), compute_share(records), hand_overs(records)
    lines = [
        f"{run}",
        "| worker | compute share | wait per turn, ms (mean) | turns | hand-over, ms (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for worker in sorted(set(waits) | set(share)):
        w, h = waits.get(worker, []), hand.get(worker, [])
        mean = f"{1000 * statistics.mean(w):.0f}" if w else "-"
        median = f"{1000 * statistics.median(h):.1f}" if h else "-"
        lines.append(f"| {worker} | {share.get(worker, 0.0):.2f} | {mean} | {len(w)} | {median} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders (MODE/seedN) of cluster.py")
    args = p.parse_args(argv)
    print("\n\n".join(table(run) for run in args.runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
