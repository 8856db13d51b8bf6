"""How soon a job follows a co-tenant, from a run of ``benchmarks/cluster.py --noisy``: for each
mode, the samples every node trained in the ``--seconds`` after each cap came on, and after each
went, summed over nodes (from the workers' step records, the caps from ``results.json``).

    python benchmarks/cap_response.py /tmp/noisy [more --out folders] [--seconds 3]

A rule that follows the cap at once keeps the free node busy as soon as the cap comes, and gives
the freed node its share back as soon as it goes; one that lags trains at the slow node's pace
for the steps it lags (docs/stragglers.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cluster_events import step_records  # benchmarks/, beside this script


def windows(result: dict, seconds: float) -> dict[str, list[tuple[float, float]]]:
    """The run's caps as wall-clock windows: ``on`` from each cap's start, ``off`` from each
    end that came before the run did (a cap that lasted to the end has none)."""
    caps = result.get("timeline", {}).get("caps", [])
    on = [(start, start + seconds) for _, start, _, _ in caps]
    off = [(end, end + seconds) for _, _, end, _ in caps if end != float("inf")]
    return {"on": on, "off": off}


def step_times(result: dict) -> list[tuple[float, int]]:
    """(time, samples) of every step of every node of the run (a joiner's too)."""
    run_dir = Path(result["run_dir"])
    return [
        (r["t"], r["samples"])
        for node in sorted(run_dir.glob("node*"))
        if node.is_dir()
        for r in step_records(node)
    ]


def samples_in(times: list[tuple[float, int]], spans: list[tuple[float, float]]) -> list[int]:
    """Samples of ``times`` in each of ``spans`` that ended before training did."""
    end = max((t for t, _ in times), default=0.0)
    return [sum(n for t, n in times if a <= t < b) for a, b in spans if b <= end]


def summarize(results: list[dict], seconds: float) -> dict[str, dict[str, list[int]]]:
    """Per mode, the samples in each window after a cap came (``on``) and went (``off``)."""
    out: dict[str, dict[str, list[int]]] = {}
    for r in results:
        if "error" in r:
            continue
        spans, times = windows(r, seconds), step_times(r)  # each run's records read once
        mode = out.setdefault(r["mode"], {"on": [], "off": []})
        for kind in ("on", "off"):
            mode[kind] += samples_in(times, spans[kind])
    return out


def table(summary: dict[str, dict[str, list[int]]], seconds: float) -> str:
    lines = [
        f"| mode | samples in the {seconds:g} s after a cap came on | after it went | events |",
        "|---|---|---|---|",
    ]
    for mode, counts in summary.items():
        cells = []
        for kind in ("on", "off"):
            values = counts[kind]
            cells.append(
                f"{statistics.median(values):.0f} ({min(values)}-{max(values)})" if values else "-"
            )
        lines.append(f"| {mode} | {cells[0]} | {cells[1]} | {len(counts['on'])} / "
                     f"{len(counts['off'])} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="--out folders of benchmarks/cluster.py runs")
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args(argv)
    results = []
    for run in args.runs:
        path = Path(run) / "results.json"
        if not path.exists():
            p.error(f"{path} not found: give the --out folder of a cluster.py run")
        results += json.loads(path.read_text())
    print(table(summarize(results, args.seconds), args.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
