"""An emulated cluster on one machine: every mode of one job under torchrun on N "nodes".

Each node is a network namespace with its own private /dev/shm (so shared memory stays within a
node, as on real hosts) and its own cores (taskset), joined to the others through a bridge by a
veth pair shaped with ``tc tbf`` in both directions (``--rates 1gbit,100mbit``). Every mode runs
the same ``torchrun ... -m wavelet.scripts.cli run`` command on every node with the c10d
rendezvous, one after another, and the report (``report.md``, ``results.json``) puts them side by
side per rate: job-wide samples/s, time to the target, the final metric, bytes per sample counted
on the nodes' interfaces, staleness, and where each step's time goes (from the records).

The modes and what each runs are in ``cluster_modes.py``.

Needs root, ``ip`` and ``tc``; nothing leaves the namespaces it makes, and it removes them. Run:

    python benchmarks/cluster.py --config configs/narrow_resnet.toml --target-acc 0.6 \\
        --rates 1gbit,100mbit --seeds 0,1 --seconds 60
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from cluster_events import (
    Disturbances,
    first_push_after,
    first_step_seen,
    node_samples,
    parse_event,
    run_logged,
    stalls,
)
from cluster_modes import MODES, job_batch_size, job_lr
from cluster_report import merge_nodes, report, shard_apply_ms, timeline_plot
from emulated_cluster import Cluster, node_command, node_cores, preflight, rate_bits

from wavelet.common import throttle
from wavelet.common.figures import run_figures
from wavelet.common.throttle import CpuCap


def run_mode(cluster: Cluster, args, mode_name: str, seed: int, run_dir: Path, port: int) -> dict:
    """One mode on every node at once, with the run's caps and events; its figures from the
    records of all nodes."""
    mode = MODES[mode_name]
    cores = node_cores(cluster.nodes, args.cores_per_node)
    job = ["--config", args.config] if args.config else []
    job += ["--epochs", "0", "--max-seconds", str(args.seconds), "--seed", str(seed)]
    if mode.batch_factor != 1:
        job += ["--batch-size", str(mode.batch_factor * args.batch_size)]
    elif args.batch_size_given:
        job += ["--batch-size", str(args.batch_size)]
    job += args.job
    if mode.lr_factor != 1.0:
        job += ["--lr", repr(mode.lr_factor * job_lr(args.config, args.job))]
    allreduce = "allreduce" in mode.args
    elastic = allreduce and bool(args.events)
    if elastic:  # what all-reduce's users do: checkpoints, restarts, an elastic rendezvous
        job += ["--checkpoint-every-s", str(args.allreduce_checkpoint_s)]
    caps = (
        [CpuCap(f"n{n}", args.cores_per_node) for n in range(cluster.nodes)] if args.cgroups else []
    )
    nodes: dict[int, subprocess.Popen] = {}  # each node's torchrun now
    spent, joiners = [], []  # torchruns a restart replaced; workers that joined
    generation = [port]  # rendezvous port of the current group (a restart takes a new one)

    def torchrun(n: int, resume: bool = False) -> list[str]:
        port = generation[0]
        nnodes = f"1:{cluster.nodes}" if elastic else str(cluster.nodes)
        rdzv = f"is_host={'true' if n == 0 else 'false'}"
        if elastic:
            # a lost node counts as gone after 3 missed keep-alives of 1 s (default: 5 s x 3)
            rdzv += ",last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", nnodes, "--nproc-per-node", str(mode.processes),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addr(0)}:{port}",
            "--rdzv-id", f"cluster-{cluster.tag}-{port}", "--local-addr", cluster.addr(n),
            "--rdzv-conf", rdzv, *(["--max-restarts", "5"] if elastic else []),
            "-m", "wavelet.scripts.cli", "run", *mode.args, "--insecure",
            "--run-dir", str(run_dir / f"node{n}"), *job, *(["--resume"] if resume else []),
        ]  # fmt: skip

    def start(n: int, command: list[str], log: Path) -> subprocess.Popen:
        cgroup = str(caps[n].procs_file) if caps else ""
        return run_logged(node_command(cluster, n, cores[n], command, cgroup), log)

    def join(n: int, at_s: float) -> None:
        """Node ``n`` started again: all-reduce does what torchrun does on any membership
        change (every node's workers restart, from rank 0's checkpoint: a new group of all
        nodes); a PS node's worker joins the running job, nobody restarts."""
        if allreduce:
            for m in range(cluster.nodes):  # torchrun's way: SIGTERM, a grace, then SIGKILL
                if m != n:
                    caps[m].stop_all()
            spent.extend(nodes.values())
            generation[0] += 1000  # a new rendezvous for the new group
            for m in range(cluster.nodes):
                suffix = "-join" if m == n else "-restart"
                nodes[m] = start(m, torchrun(m, resume=True), run_dir / f"node{m}{suffix}.log")
            return
        node0 = run_dir / "node0"
        command = [
            sys.executable, "-m", "wavelet.scripts.cli", "worker",
            "--join", (node0 / "ps-0.addr").read_text().strip(),
            "--join-token-file", str(node0 / "admin-0.token"),
            "--run-dir", str(run_dir / f"node{n}-join"), "--threads", str(args.cores_per_node),
            "--max-seconds", str(max(1.0, args.seconds - at_s)), "--no-report",
        ]  # fmt: skip
        joiners.append((time.time(), start(n, command, run_dir / f"node{n}-join.log")))

    before = cluster.tx_bytes()
    started = time.time()
    training, done = threading.Event(), threading.Event()
    disturbances = Disturbances(caps, args, training, join)
    try:
        for n in range(cluster.nodes):
            (run_dir / f"node{n}").mkdir(parents=True, exist_ok=True)
            nodes[n] = start(n, torchrun(n), run_dir / f"node{n}.log")
        first_step_seen(run_dir, cluster.nodes, training, done)
        disturbances.start()
        deadline = time.monotonic() + args.seconds + args.grace_s
        codes = _wait_nodes(nodes, run_dir, deadline)
    finally:
        done.set()
        disturbances.stop()
        for proc in [*nodes.values(), *spent, *(p for _, p in joiners)]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for cap in caps:
            cap.close()  # whatever a node left, in any session, goes
    sent = cluster.tx_bytes() - before
    result = {"mode": mode_name, "seed": seed, "run_dir": str(run_dir), "codes": codes}
    lost = {e.node for e in args.events if e.kind in ("leave", "preempt")}
    if codes[0] != 0 or any(c != 0 for n, c in enumerate(codes) if n not in lost):
        result["error"] = f"exit codes {codes}; see {run_dir}/node*.log"
        return result
    # the copies an all-reduce group took before a restart stopped it, tested now: its time to
    # target counts every life of the job, as Wavelet's does
    from wavelet.worker.evaluate import test_saved_copies

    test_saved_copies(run_dir / "node0")
    merged = merge_nodes(run_dir, cluster.nodes)
    figures = run_figures(merged, args.target_acc)
    samples = figures.samples_per_s * figures.train_seconds
    summary = json.loads((run_dir / "node0" / "summary.json").read_text())
    first_event = min((e["t"] for e in disturbances.timeline.events), default=None)
    result.update(
        # a job that lost or gained a node: its summary covers the workers torchrun saw end;
        # the merged records cover every life of every node (one clock here)
        samples_per_s=(
            figures.samples_per_s
            if args.events
            else summary.get("samples_per_s", figures.samples_per_s)
        ),
        time_to_target_s=figures.time_to_target_s,
        final_score=figures.final_score,
        metric=figures.metric,
        link_bytes_per_sample=sent / samples if samples else None,
        staleness_mean=(
            statistics.mean(w["mean"] for w in figures.staleness.values())
            if figures.staleness
            else None
        ),
        step_ms={k: 1000 * v for k, v in figures.step_means.items()},
        shard_apply_ms=shard_apply_ms(merged),
        batch=mode.batch_factor * args.batch_size,
        wall_s=time.time() - started,
        samples_per_node=node_samples(run_dir, cluster.nodes),
        # the nodes that stayed: their longest time without a step, after the first event
        max_stall_s=stalls(run_dir, 0, first_event) if first_event else None,
        join_first_push_s=(
            first_push_after(
                run_dir / f"node{next(e.node for e in args.events if e.kind == 'join')}-join",
                joiners[0][0],
            )
            if joiners
            else None
        ),
        timeline=dataclasses.asdict(disturbances.timeline),
        lost_updates=summary.get("lost_updates"),
    )
    return result


# torchrun's agent waits up to 300 s at its exit barrier for the agents of lost nodes, which
# never come: once its node's summary is out and its own workers are gone, that wait is cut
EXIT_BARRIER_CUT_S = 15.0


def _wait_nodes(nodes: dict[int, subprocess.Popen], run_dir: Path, deadline: float) -> list:
    """Each node's exit status (None: past the deadline), waiting on whichever torchrun each
    node runs now (a restart replaces them). A node 0 done with its job but held in torchrun's
    exit barrier by a lost node counts as done (0)."""
    codes: dict[int, int | None] = {}
    done_at, cut = None, False
    while time.monotonic() < deadline and len(codes) < len(nodes):
        time.sleep(0.5)
        for n, proc in list(nodes.items()):
            code = proc.poll()
            if n == 0 and cut:
                continue  # counted as done when its exit barrier was cut
            if code is not None and nodes[n] is proc:  # not replaced meanwhile
                codes[n] = code
            elif code is None:
                codes.pop(n, None)  # a node started again
        if 0 not in codes and (run_dir / "node0" / "summary.json").exists():
            done_at = done_at or time.monotonic()
            if time.monotonic() - done_at > EXIT_BARRIER_CUT_S:
                print("   node 0 done; its torchrun waits at its exit barrier: cut", flush=True)
                os.killpg(nodes[0].pid, signal.SIGKILL)
                nodes[0].wait(10)
                codes[0], cut = 0, True
    return [codes.get(n) for n in sorted(nodes)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cores-per-node", type=int, default=1)
    p.add_argument("--rates", default="1gbit,100mbit", help="comma-separated tc rates")
    p.add_argument("--modes", default="ticktock,single,allreduce,allreduce-2x")
    p.add_argument("--config", default="configs/narrow_resnet.toml")
    p.add_argument("--batch-size", type=int, default=None, help="per wave (default: the job's)")
    p.add_argument("--seconds", type=float, default=60.0, help="training time per run")
    p.add_argument("--grace-s", type=float, default=240.0, help="start and final test, per run")
    p.add_argument("--target-acc", type=float, default=0.6)
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", default="runs/cluster")
    p.add_argument("--report-only", action="store_true", help="rewrite the report of --out")
    p.add_argument(
        "--slow", action="append", default=[], metavar="NODE:PCT",
        help="cap every process of node NODE at PCT%% of its cores for the whole run",
    )  # fmt: skip
    p.add_argument(
        "--noisy", action="append", default=[], metavar="NODE:ON_S:OFF_S:PCT",
        help="a co-tenant on node NODE: capped at PCT%% for ON_S seconds, free for OFF_S, again",
    )  # fmt: skip
    for kind, what in (
        ("leave", "kill -9 every process of node NODE, T seconds into training"),
        ("preempt", "SIGTERM to every process of node NODE (a preemption notice) at T"),
        ("join", "start node NODE's worker again at T (all-reduce: its torchrun)"),
    ):
        p.add_argument(f"--{kind}", action="append", default=[], metavar="NODE@T", help=what)
    p.add_argument(
        "--allreduce-checkpoint-s", type=float, default=2.0,
        help="with --leave/--preempt/--join: all-reduce's rank 0 checkpoints this often",
    )  # fmt: skip
    p.add_argument("job", nargs="*", help="more job flags for `wavelet run`, after --")
    args = p.parse_args(argv)
    args.rates = args.rates.split(",")
    args.modes = args.modes.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    if args.nodes < 2:
        p.error("--nodes must be at least 2")
    for rate in args.rates:
        try:
            rate_bits(rate)  # a bad rate is refused now, not after the namespaces are made
        except ValueError as e:
            p.error(str(e))
    try:  # bad caps and events are refused now, in one line
        args.slow = [throttle.parse_cap(s, "--slow", args.nodes) for s in args.slow]
        args.noisy = [throttle.parse_noisy(s, args.nodes) for s in args.noisy]
        args.events = [
            parse_event(kind, text, args.nodes)
            for kind in ("leave", "preempt", "join")
            for text in getattr(args, kind)
        ]
    except ValueError as e:
        p.error(str(e))
    # every node gets a cgroup where there is a writable cpu controller: caps, and kills that
    # reach everything a node started; caps and events need one
    args.cgroups = throttle.why_not() is None
    if (args.slow or args.noisy or args.events) and not args.cgroups:
        p.error(f"--slow, --noisy, --leave, --preempt and --join: {throttle.why_not()}")
    args.batch_size_given = args.batch_size is not None
    if args.batch_size is None:
        args.batch_size = job_batch_size(args.config)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_only:  # the same flags as the run, for the report's words
        results = json.loads((Path(args.out) / "results.json").read_text())
        (Path(args.out) / "report.md").write_text(
            report(results, args, {k: m.description for k, m in MODES.items()})
        )
        print(report(results, args, {k: m.description for k, m in MODES.items()}))
        return 0
    why = preflight()
    if why:
        print(f"cluster.py: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    # a TERM (kill, a timeout) unwinds like Ctrl-C: the runs' processes and the namespaces go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cluster = Cluster(args.nodes).open()
    port = 29400
    try:
        # rounds of every mode, so that the machine's drift hits all modes alike
        for seed in args.seeds:
            for rate in args.rates:
                cluster.shape(rate)
                for mode in args.modes:
                    port += 1
                    run_dir = out / rate / mode / f"seed{seed}"
                    if run_dir.exists():
                        shutil.rmtree(run_dir)
                    run_dir.mkdir(parents=True)
                    print(f"== {rate} {mode} seed {seed}", flush=True)
                    r = run_mode(cluster, args, mode, seed, run_dir, port)
                    r["rate"] = rate
                    results.append(r)
                    shown = {k: v for k, v in r.items() if k not in ("step_ms", "timeline")}
                    print(f"   {json.dumps(shown)}", flush=True)
                    if "error" not in r and (args.slow or args.noisy or args.events):
                        timeline_plot(r, cluster.nodes, out / f"timeline-{mode}-seed{seed}.png")
                    (out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        cluster.close()
    text = report(results, args, {k: m.description for k, m in MODES.items()})
    (out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
