"""The cluster benchmark's figures and report: records of every node merged, per-mode tables
(``benchmarks/cluster.py``)."""

from __future__ import annotations

import math
import shutil
import statistics
from pathlib import Path

from emulated_cluster import rate_bits  # benchmarks/, beside this script
from summarize_updates import median_range

from wavelet.common.records import read_records


def shard_apply_ms(run_dir: Path) -> float | None:
    """Median time a shard spent on one push (read, checks, update), from its push records."""
    times = [
        r["apply_s"]
        for path in (run_dir / "records").glob("ps-*-pushes.jsonl")
        for r in read_records(path)
        if "apply_s" in r
    ]
    return 1000 * statistics.median(times) if times else None


def time_to_target_median(runs: list[dict]) -> float | None:
    """The median time to the target over ``runs``, a run that never reached it counting as
    later than any that did (inf where the median is one of those; None: no runs). The median
    of the reached runs alone would favour a mode that missed: all-reduce reaching 60% at 17.1
    and 30.3 s and missing it in the third seed has a median of 30.3 s, not 23.7."""
    if not runs:
        return None
    return statistics.median(
        r["time_to_target_s"] if r["time_to_target_s"] is not None else math.inf for r in runs
    )


def link_ms_per_step(result: dict, rate: str) -> float | None:
    """What one task's step moves over its node's link, in ms at ``rate``: half the bytes that
    crossed per sample go each way (push up, pull down; a ring's send and receive), full duplex."""
    if not (result.get("link_bytes_per_sample") and result.get("batch")):
        return None
    return 1000 * result["link_bytes_per_sample"] * result["batch"] / 2 * 8 / rate_bits(rate)


def merge_nodes(run_dir: Path, nodes: int) -> Path:
    """One run dir with every node's records (file names carry global ranks and shard
    indices, so they never collide) and node 0's job and summary: the nodes share one clock
    here, so the figures of the whole job come from it."""
    merged = run_dir / "merged"
    (merged / "records").mkdir(parents=True, exist_ok=True)
    for n in range(nodes):
        for path in (run_dir / f"node{n}" / "records").glob("*.jsonl"):
            shutil.copy(path, merged / "records" / path.name)
        # a node started again (--join) has the slot (and file names) it had: its records
        # go on where the first ones stopped
        for path in (run_dir / f"node{n}-join" / "records").glob("*.jsonl"):
            with open(merged / "records" / path.name, "ab") as out:
                out.write(path.read_bytes())
    for name in ("job.json", "summary.json"):
        if (run_dir / "node0" / name).exists():
            shutil.copy(run_dir / "node0" / name, merged / name)
    return merged


def report(results: list[dict], args, descriptions: dict[str, str]) -> str:
    """The report of ``results`` (``descriptions``: each mode's, by name)."""
    lines = [
        f"# Emulated cluster: {args.nodes} nodes, {args.cores_per_node} core(s) each",
        "",
        f"Job: `{args.config or 'default'}` {' '.join(args.job)}; {args.seconds:g} s per run; "
        f"target {args.target_acc:g}; seeds {args.seeds}. Median (range) over seeds; *vs "
        "allreduce* divides by all-reduce's median at the same rate (samples/s: higher is "
        "better; time to target: lower is better). *link ms / step*: what one task's step "
        "moves over its node's link, at the link's rate (half the bytes each way). *shard ms / "
        "push*: a shard's own work per push (read, checks, update), from its records.",
        "",
    ]
    for rate in args.rates:
        at_rate = [r for r in results if r["rate"] == rate]
        ok = [r for r in at_rate if "error" not in r]
        base = [r for r in ok if r["mode"] == "allreduce"]
        base_sps = statistics.median(r["samples_per_s"] for r in base) if base else None
        base_ttt_med = time_to_target_median(base)
        lines += [
            f"## {rate}",
            "",
            "| mode | samples/s | vs allreduce | time to target, s | reached | vs allreduce "
            "| final | link MB / sample | link ms / step | staleness | step ms (fwd / bwd / "
            "push+pull / pull in fwd / baton / bwd+allreduce) | shard ms / push |",
            "|---|---|---:|---|---|---:|---|---:|---:|---:|---|---:|",
        ]
        for mode in args.modes:
            runs = [r for r in ok if r["mode"] == mode]
            failed = [r for r in at_rate if r["mode"] == mode and "error" in r]
            if not runs:
                lines.append(f"| {mode} | failed: {failed[0]['error'] if failed else '-'} |")
                continue
            sps = [r["samples_per_s"] for r in runs]
            ttt = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
            final = [r["final_score"] for r in runs if r["final_score"] is not None]
            mb = [r["link_bytes_per_sample"] / 1e6 for r in runs if r["link_bytes_per_sample"]]
            stale = [r["staleness_mean"] for r in runs if r["staleness_mean"] is not None]
            link = [v for v in (link_ms_per_step(r, rate) for r in runs) if v is not None]
            apply = [r["shard_apply_ms"] for r in runs if r.get("shard_apply_ms") is not None]
            parts = ["forward_s", "backward_s", "push_pull_s", "pull_wait_s", "baton_wait_s"]
            parts.append("backward_allreduce_s")
            step = " / ".join(
                f"{statistics.median(r['step_ms'][p] for r in runs):.0f}"
                if all(p in r["step_ms"] for r in runs)
                else "-"
                for p in parts
            )
            vs_sps = f"{statistics.median(sps) / base_sps:.2f}x" if base_sps else "-"
            ttt_med = time_to_target_median(runs)
            finite = ttt_med is not None and ttt_med < math.inf
            vs_ttt = "-"
            if finite and base_ttt_med is not None:
                vs_ttt = f"{ttt_med / base_ttt_med:.2f}x" if base_ttt_med < math.inf else "<1x"
            ttt_text = "not reached" if ttt_med == math.inf else "-"
            if finite:
                ttt_text = f"{ttt_med:.1f}" + (
                    f" ({min(ttt):.1f}-{max(ttt):.1f})" if len(ttt) > 1 else ""
                )
            lines.append(
                f"| {mode} | {median_range(sps, 0)} | {vs_sps} | "
                f"{ttt_text} | {len(ttt)}/{len(runs)} | {vs_ttt} | "
                f"{median_range(final, 3)} | {median_range(mb, 3)} | "
                f"{median_range(link, 0)} | {median_range(stale, 2)} | {step} | "
                f"{median_range(apply, 1)} |"
            )
        lines.append("")
        lines += _disturbed(ok, args)
    lines += ["Modes:", ""] + [f"- `{m}`: {descriptions[m]}" for m in args.modes]
    return "\n".join(lines) + "\n"


def _disturbed(runs: list[dict], args) -> list[str]:
    """Where the run had caps or membership changes: what each mode's nodes did through them."""
    if not (args.slow or args.noisy or args.events):
        return []
    what = [f"--slow {n}:{p:g}" for n, p in args.slow]
    what += [f"--noisy {n}:{a:g}:{b:g}:{p:g}" for n, a, b, p in args.noisy]
    what += [f"--{e.kind} {e.node}@{e.at_s:g}" for e in args.events]
    lines = [
        f"Disturbances: {' '.join(what)}. *stall*: node 0's longest time without a step after "
        "the first event; *first push*: from the process start of a node started again to its "
        "first step; *samples per node*: what each node's workers trained. Timelines: "
        "`timeline-<mode>-seed<N>.png` beside this report.",
        "",
        "| mode | seed | stall, s | first push, s | samples per node | lost updates |",
        "|---|---|---:|---:|---|---:|",
    ]
    for r in runs:
        stall = f"{r['max_stall_s']:.2f}" if r.get("max_stall_s") is not None else "-"
        first = f"{r['join_first_push_s']:.2f}" if r.get("join_first_push_s") is not None else "-"
        per_node = " / ".join(str(s) for s in r.get("samples_per_node", []))
        lines.append(
            f"| {r['mode']} | {r['seed']} | {stall} | {first} | {per_node} | "
            f"{r.get('lost_updates', '-')} |"
        )
    return [*lines, ""]


def timeline_plot(result: dict, nodes: int, path: Path) -> None:
    """Each node's samples/s (1 s bins) and the test metric over the run, capped periods shaded
    and membership events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(result["run_dir"])
    steps: dict[int, list[tuple[float, int]]] = {}
    scores = []
    for n in range(nodes):
        for d in (run_dir / f"node{n}", run_dir / f"node{n}-join"):
            for p in d.glob("records/worker-*-wave-*.jsonl"):
                for rec in read_records(p):
                    if rec.get("kind") == "step":
                        steps.setdefault(n, []).append((rec["t"], rec["samples"]))
                    elif rec.get("kind") == "eval":  # t: when the tested weights were current
                        scores.append((rec["t"], rec.get("score", rec.get("test_acc"))))
    if not steps:
        return
    t0 = min(t for s in steps.values() for t, _ in s)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for n, s in sorted(steps.items()):
        bins: dict[int, int] = {}
        for t, samples in s:
            bins[int(t - t0)] = bins.get(int(t - t0), 0) + samples
        xs = range(0, max(bins) + 1)
        top.plot(list(xs), [bins.get(x, 0) for x in xs], label=f"node {n}")
    for node, start, end, _pct in result.get("timeline", {}).get("caps", []):
        end = end if end != float("inf") else max(t for s in steps.values() for t, _ in s)
        for ax in (top, bottom):  # from the first step on: a cap set before it shades no time
            ax.axvspan(max(0.0, start - t0), end - t0, alpha=0.12, color=f"C{node}")
    for e in result.get("timeline", {}).get("events", []):
        for ax in (top, bottom):
            ax.axvline(e["t"] - t0, color=f"C{e['node']}", linestyle="--", linewidth=1)
        top.annotate(f"{e['kind']} {e['node']}", (e["t"] - t0, 0), fontsize=8, rotation=90)
    top.set_ylabel("samples / s")
    top.legend(fontsize=8)
    scores = sorted((t - t0, v) for t, v in scores if v is not None)
    if scores:
        bottom.plot([t for t, _ in scores], [v for _, v in scores], marker=".")
    bottom.set_ylabel(result.get("metric") or "accuracy")
    bottom.set_xlabel("seconds since the first step")
    top.set_title(f"{result['mode']}, seed {result['seed']}: shaded = capped, dashed = events")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
