"""How many clients a shard serves: C clients against S shards, over TCP or shared memory, for
a small and a large model, bulk-synchronous or asynchronous (docs/performance.md, "The
parameter server at scale").

Clients do no compute: each pushes a constant gradient and pulls the weights, as fast as the
shards let it, for ``--seconds`` per point. They run as threads (each with its own sockets, as a
wave's client has) in a few processes, so that 64 of them fit a 2-core machine. Per point:
pushes/s, bytes/s through the shards, p50 / p99 / max of a push's round trip (push and pull, one
request) and of a pull alone, the shards' CPU seconds per push, and the fairness across clients
(fewest and most pushes). ``results.json`` has one entry per point, ``report.md`` the table, the
limit each curve hits and the sizing table; ``throughput.png`` and ``p99.png`` plot them.

    python benchmarks/ps_scale.py --clients 2,16,64 --shards 1 --model-mb 1 --transport tcp
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = 4  # client processes at most; clients beyond are threads in them
PULL_EVERY = 20  # one pull alone every this many pushes, for the pull's own latency


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Shards:
    """``count`` ``wavelet ps`` daemons of one point."""

    def __init__(self, count: int, clients: int, updates: str, run_dir: Path):
        self.procs, self.addresses = [], []
        staleness = "0" if updates == "bsp" else "inf"
        expect = str(clients) if updates == "bsp" else "0"
        for i in range(count):
            ready = run_dir / f"ps-{i}.addr"
            cmd = [
                sys.executable, "-m", "wavelet.scripts.cli", "--log-level", "WARNING", "ps",
                "--shards", str(count), "--shard-index", str(i), "--staleness", staleness,
                "--updates", "async", "--expect-waves", expect, "--ready-file", str(ready),
                "--run-dir", str(run_dir), "--max-waves", "256",
                "--wave-timeout-s", "600",
            ]  # fmt: skip
            log = open(run_dir / f"ps-{i}.log", "wb")  # noqa: SIM115 (the process keeps it)
            self.procs.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())
            )
        deadline = time.monotonic() + 120
        for i in range(count):
            ready = run_dir / f"ps-{i}.addr"
            while not ready.exists():
                if time.monotonic() > deadline or self.procs[i].poll() is not None:
                    raise RuntimeError(f"shard {i} did not start: see {run_dir}")
                time.sleep(0.05)
            self.addresses.append(ready.read_text().strip())

    def cpu_seconds(self) -> float:
        return sum(_cpu_seconds(p.pid) for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def run_clients(args: dict, first: int, count: int, start_at: float, results) -> None:
    """Process body: ``count`` clients as threads, numbered from ``first``."""
    import torch

    from wavelet.common.sharding import ShardingPlan
    from wavelet.worker.client import PSClient

    torch.set_num_threads(1)
    numel = int(args["model_mb"] * (1 << 20)) // 4
    out = []

    def client(index: int) -> None:
        weight = torch.nn.Parameter(torch.zeros(numel))
        weight.grad = torch.full((numel,), 1e-6)
        plan = ShardingPlan.build([("w", weight, True)], len(args["addresses"]), 4 << 20)
        c = PSClient(
            args["addresses"], plan, {"w": weight}, f"c{index}", 0, 600.0,
            transport=args["transport"],
        )  # fmt: skip
        pushes, push_ms, pull_ms = 0, [], []
        try:
            c.register(0)
            pulled = c.pull(0)
            while time.time() < start_at:
                time.sleep(0.01)
            end = start_at + args["seconds"]
            clock = 0
            while time.time() < end:
                t = time.perf_counter()
                pulled = c.push_pull(clock, pulled.versions)
                push_ms.append(1000 * (time.perf_counter() - t))
                clock += 1
                pushes += 1
                if pushes % PULL_EVERY == 0:
                    t = time.perf_counter()
                    c.pull(clock, observer=True)
                    pull_ms.append(1000 * (time.perf_counter() - t))
            out.append({"client": index, "pushes": pushes, "push_ms": push_ms, "pull_ms": pull_ms})
        except Exception as e:  # a client that fails is reported, not lost
            out.append({"client": index, "pushes": pushes, "error": f"{type(e).__name__}: {e}"})
        finally:
            try:
                c.goodbye()
            finally:
                c.close()

    threads = [threading.Thread(target=client, args=(first + k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(out)


def run_point(clients: int, shards: int, transport: str, model_mb: float, updates: str, seconds):
    with tempfile.TemporaryDirectory(prefix="ps-scale-") as tmp:
        daemons = Shards(shards, clients, updates, Path(tmp))
        try:
            cpu_before = daemons.cpu_seconds()
            args = {
                "addresses": daemons.addresses,
                "transport": transport,
                "model_mb": model_mb,
                "seconds": seconds,
            }
            processes = min(PROCESSES, clients)
            share = [clients // processes + (k < clients % processes) for k in range(processes)]
            # every client registers and pulls first (imports, a start barrier under BSP)
            start_at = time.time() + 20 + 0.3 * clients
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            procs, first = [], 0
            for n in share:
                p = ctx.Process(target=run_clients, args=(args, first, n, start_at, queue))
                p.start()
                procs.append(p)
                first += n
            rows = []
            for _ in procs:
                rows += queue.get(timeout=seconds + 300 + clients)
            for p in procs:
                p.join(60)
            cpu = daemons.cpu_seconds() - cpu_before
        finally:
            daemons.close()
    return _figures(rows, clients, shards, transport, model_mb, updates, seconds, cpu)


def _figures(rows, clients, shards, transport, model_mb, updates, seconds, cpu) -> dict:
    pushes = [r["pushes"] for r in rows]
    push_ms = sorted(ms for r in rows for ms in r.get("push_ms", []))
    pull_ms = sorted(ms for r in rows for ms in r.get("pull_ms", []))
    total = sum(pushes)
    per_s = total / seconds

    def q(values, p):
        return values[min(len(values) - 1, int(p * len(values)))] if values else None

    return {
        "clients": clients,
        "shards": shards,
        "transport": transport,
        "model_mb": model_mb,
        "updates": updates,
        "pushes_per_s": per_s,
        # each push carries the model's gradients up and its weights back, over all shards
        "bytes_per_s": per_s * 2 * model_mb * (1 << 20),
        "push_p50_ms": q(push_ms, 0.5),
        "push_p99_ms": q(push_ms, 0.99),
        "push_max_ms": push_ms[-1] if push_ms else None,
        "pull_p50_ms": q(pull_ms, 0.5),
        "pull_p99_ms": q(pull_ms, 0.99),
        "shard_cpu_s_per_push": cpu / total if total else None,
        "shard_cpu_busy": cpu / seconds / shards,  # 1.0: each shard's core fully busy
        "min_pushes": min(pushes) if pushes else 0,
        "max_pushes": max(pushes) if pushes else 0,
        "errors": [r["error"] for r in rows if "error" in r],
    }


def limit(point: dict) -> str:
    """Which limit the point hit, from its own numbers."""
    if point["errors"]:
        return "failures"
    if point["shard_cpu_busy"] >= 0.8:
        return "the shards' CPU"
    if point["transport"] == "shm" and point["model_mb"] >= 8:
        return "copies (memory bandwidth)"
    if point["transport"] == "tcp" and point["bytes_per_s"] > 1e9:
        return "the loopback link and ZeroMQ's copies"
    return "the clients (one request each in flight)"


def report(points: list[dict], out: Path) -> str:
    lines = [
        "# The parameter server at scale",
        "",
        "C clients (no compute) against S shards on this machine, each point run alone. "
        "*fair*: fewest / most pushes of one client. *limit*: what the shards' CPU, the bytes "
        "moved and the transport say held the point back.",
        "",
        "| clients | shards | transport | model MB | updates | pushes/s | MB/s | push p50 / p99 / "
        "max ms | pull p50 / p99 ms | shard CPU s / push | fair (min / max) | limit |",
        "|---:|---:|---|---:|---|---:|---:|---|---|---:|---|---|",
    ]
    for p in points:
        ms = "/".join(f"{p[k]:.1f}" if p[k] is not None else "-" for k in
                      ("push_p50_ms", "push_p99_ms", "push_max_ms"))  # fmt: skip
        pull = "/".join(f"{p[k]:.1f}" if p[k] is not None else "-" for k in
                        ("pull_p50_ms", "pull_p99_ms"))  # fmt: skip
        cpu = p["shard_cpu_s_per_push"]
        lines.append(
            f"| {p['clients']} | {p['shards']} | {p['transport']} | {p['model_mb']:g} | "
            f"{p['updates']} | {p['pushes_per_s']:.0f} | {p['bytes_per_s'] / 1e6:.0f} | {ms} | "
            f"{pull} | {cpu * 1000 if cpu else 0:.2f} ms | {p['min_pushes']} / "
            f"{p['max_pushes']} | {limit(p)} |"
        )
    lines += ["", *sizing(points)]
    return "\n".join(lines) + "\n"


def sizing(points: list[dict]) -> list[str]:
    """Shards needed for W workers of a model of M MB on links of L Gbit/s, from the most bytes
    per second one shard moved here (per transport): each worker step pushes M and pulls M."""
    tcp = [p for p in points if p["transport"] == "tcp" and not p["errors"]]
    if not tcp:
        return []
    best = max(tcp, key=lambda p: p["bytes_per_s"] / p["shards"])
    per_shard = best["bytes_per_s"] / best["shards"]
    lines = [
        "## Sizing",
        "",
        f"One shard moved at most {per_shard / 1e6:.0f} MB/s here (TCP, {best['clients']} "
        f"clients, {best['model_mb']:g} MB model, limit: {limit(best)}). A job of W workers "
        "taking r steps/s each on a model of M bytes moves 2 x W x r x M bytes/s through its "
        "shards (gradients up, weights back), so it needs ceil(2 W r M / min(that per shard, "
        "a shard host's link)) shards; on one host, cores for the shards as well. For r = 1 "
        "step/s per worker:",
        "",
        "| workers | model | link | bytes/s needed | shards (this machine's shard speed) | "
        "shards (link-bound) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for workers in (8, 32, 128):
        for model_mb in (1, 100):
            for gbit in (10, 25):
                need = 2 * workers * model_mb * (1 << 20)
                link = gbit * 1e9 / 8
                lines.append(
                    f"| {workers} | {model_mb} MB | {gbit} Gbit/s | {need / 1e9:.2f} GB/s | "
                    f"{math.ceil(need / min(per_shard, link))} | {math.ceil(need / link)} |"
                )
    return [*lines, ""]


def plots(points: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, name, label in (
        ("pushes_per_s", "throughput.png", "pushes / s"),
        ("push_p99_ms", "p99.png", "push p99, ms"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        curves: dict[tuple, list] = {}
        for p in points:
            tag = (p["shards"], p["transport"], p["model_mb"], p["updates"])
            curves.setdefault(tag, []).append((p["clients"], p[key] or 0))
        for (shards, transport, mb, updates), xy in sorted(curves.items()):
            xy.sort()
            ax.plot(*zip(*xy, strict=True), marker="o",
                    label=f"S={shards} {transport} {mb:g} MB {updates}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clients")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,2,4,8,16,32,64")
    p.add_argument("--shards", default="1,2,4")
    p.add_argument("--transport", default="tcp,shm")
    p.add_argument("--model-mb", default="1,44")
    p.add_argument("--updates", default="async,bsp")
    p.add_argument("--seconds", type=float, default=8.0, help="measured time per point")
    p.add_argument("--out", default="runs/ps-scale")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = []
    for updates in args.updates.split(","):
        for transport in args.transport.split(","):
            for model_mb in (float(m) for m in args.model_mb.split(",")):
                for shards in _ints(args.shards):
                    for clients in _ints(args.clients):
                        label = f"C={clients} S={shards} {transport} {model_mb:g}MB {updates}"
                        print(f"== {label}", flush=True)
                        point = run_point(
                            clients, shards, transport, model_mb, updates, args.seconds
                        )
                        points.append(point)
                        shown = {k: v for k, v in point.items() if k != "errors"}
                        print(f"   {json.dumps(shown)}", flush=True)
                        (out / "results.json").write_text(json.dumps(points, indent=1))
    (out / "report.md").write_text(report(points, out))
    plots(points, out)
    print(report(points, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
