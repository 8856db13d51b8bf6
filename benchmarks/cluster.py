"""An emulated cluster on one machine: every mode of one job under torchrun on N "nodes".

Each node is a network namespace with its own private /dev/shm (so shared memory stays within a
node, as on real hosts) and its own cores (taskset), joined to the others through a bridge by a
veth pair shaped with ``tc tbf`` in both directions (``--rates 1gbit,100mbit``). Every mode runs
the same ``torchrun ... -m wavelet.scripts.cli run`` command on every node with the c10d
rendezvous, one after another, and the report (``report.md``, ``results.json``) puts them side by
side per rate: job-wide samples/s, time to the target, the final metric, bytes per sample counted
on the nodes' interfaces, staleness, and where each step's time goes (from the records).

Modes: ``ticktock`` (one shard and one worker of two waves per node), ``ticktock-layers`` (chunks
placed by layers, so that pushes overlap backward), ``ticktock-after`` (the same, pushing after
backward), ``ticktock-pull`` (the same as ``ticktock-layers``, each layer's forward starting as
soon as its weights are in), ``ticktock-groups`` and ``ticktock-groups-mc`` (wave groups, with
momentum correction), ``ticktock-turns`` and ``ticktock-turns-pull`` (wave turns, and the same
pulling during forward), ``bsp`` (bulk-synchronous: every wave of a clock averaged into one
update), ``single`` and ``single-pull`` (one wave, and the same pulling during forward),
``allreduce`` (one DDP rank per node at one wave's batch: about tick-tock's memory per device),
``allreduce-2x`` (one rank per node at the batch of both waves: twice the activations).
The learning rate is the job's, except where one update averages more samples than all-reduce's
at one wave's batch: ``bsp`` (all waves of a clock) and ``allreduce-2x`` take it times the
samples per update over all-reduce's (linear scaling, as ``wavelet compare --memory-budget``).

Needs root, ``ip`` and ``tc``; nothing leaves the namespaces it makes, and it removes them. Run:

    python benchmarks/cluster.py --config configs/narrow_resnet.toml --target-acc 0.6 \\
        --rates 1gbit,100mbit --seeds 0,1 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from summarize_updates import median_range  # benchmarks/, beside this script

from wavelet.common.figures import run_figures

SUBNET = "169.254.78"  # link-local addresses inside the namespaces only


@dataclass(frozen=True)
class Mode:
    description: str
    processes: int  # per node
    args: tuple[str, ...]
    batch_factor: int = 1
    lr_factor: float = 1.0  # the job's lr times this: samples per update over all-reduce's


MODES = {
    "ticktock": Mode(
        "PS: 1 shard + 1 worker of 2 waves per node, asynchronous updates",
        2,
        ("--shards-per-node", "1", "--updates", "async"),
    ),
    "ticktock-layers": Mode(
        "the same with chunks placed by layers: the push to the last layers' shard leaves "
        "while backward goes on",
        2,
        ("--shards-per-node", "1", "--placement", "layers", "--updates", "async"),
    ),
    "ticktock-after": Mode(
        "the same as ticktock-layers, pushing only after backward (the old way)",
        2,
        ("--shards-per-node", "1", "--placement", "layers", "--updates", "async")
        + ("--push-during-backward", "false"),
    ),
    "ticktock-pull": Mode(
        "the same as ticktock-layers, each layer's forward starting as soon as its own weights "
        "are in (pull during forward, parts of 256 KiB)",
        2,
        ("--shards-per-node", "1", "--placement", "layers", "--updates", "async")
        + ("--pull-during-forward", "true"),
    ),
    "ticktock-groups": Mode(
        "PS, wave groups: the tick waves of all nodes average into one update, the tock waves "
        "into the next (the paper's synchronous design)",
        2,
        ("--shards-per-node", "1", "--updates", "wave-groups"),
    ),
    "ticktock-groups-mc": Mode(
        "wave groups with momentum corrected for their two asynchronous update streams",
        2,
        ("--shards-per-node", "1", "--updates", "wave-groups", "--momentum-correction", "true"),
    ),
    "ticktock-turns": Mode(
        "PS, wave groups in strict turns: each group reads the other's latest update (no "
        "staleness; a group's forward waits for the other's update)",
        2,
        ("--shards-per-node", "1", "--updates", "wave-turns"),
    ),
    "ticktock-turns-pull": Mode(
        "wave turns, each layer's forward starting as soon as its own weights are in (pull "
        "during forward)",
        2,
        ("--shards-per-node", "1", "--updates", "wave-turns", "--pull-during-forward", "true"),
    ),
    "bsp": Mode(
        "PS, bulk-synchronous: the waves of all nodes average into one update per clock "
        "(staleness 0; the lr times 2: twice all-reduce's samples per update)",
        2,
        ("--shards-per-node", "1", "--staleness", "0"),
        lr_factor=2.0,
    ),
    "single": Mode(
        "PS: 1 shard + 1 worker of 1 wave per node", 2, ("--shards-per-node", "1", "--waves", "1")
    ),
    "single-pull": Mode(
        "the same as single, each layer's forward starting as soon as its own weights are in "
        "(pull during forward)",
        2,
        ("--shards-per-node", "1", "--waves", "1", "--pull-during-forward", "true"),
    ),
    "allreduce": Mode("DDP: 1 rank per node at one wave's batch", 1, ("--mode", "allreduce")),
    "allreduce-2x": Mode(
        "DDP: 1 rank per node at the batch of both waves (2x activations)",
        1,
        ("--mode", "allreduce"),
        batch_factor=2,
        lr_factor=2.0,
    ),
}


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


def preflight() -> str | None:
    """Why this machine cannot run the benchmark, in one line; None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc): run it as root or with sudo"
    for tool in ("ip", "tc", "taskset"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2, util-linux) on PATH"
    return None


def rate_bits(rate: str) -> float:
    """``1gbit``, ``100mbit``, ``500kbit`` in bits per second."""
    for suffix, scale in {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}.items():
        if rate.endswith(suffix):
            try:
                return float(rate[: -len(suffix)]) * scale
            except ValueError:
                break
    raise ValueError(f"--rates: {rate!r} is not like 1gbit, 100mbit or 500kbit")


def tbf(rate: str) -> list[str]:
    """A token bucket at ``rate`` whose burst exceeds the MTU and one timer tick's worth."""
    burst = max(32 * 1024, int(rate_bits(rate) / 8 / 250))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


@dataclass
class Cluster:
    """N namespaces on a bridge; ``close()`` deletes them (their links go with them)."""

    nodes: int
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    made: list[str] = field(default_factory=list)

    def ns(self, i: int) -> str:
        return f"wvc-{self.tag}-n{i}"

    def dev(self, i: int) -> str:
        return f"wc{self.tag}n{i}"

    def port(self, i: int) -> str:
        """The bridge's end of node ``i``'s link."""
        return f"wc{self.tag}s{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def switch(self) -> str:
        return f"wvc-{self.tag}-sw"

    def open(self) -> Cluster:
        sh("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, dev, port = self.ns(i), self.dev(i), self.port(i)
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "link", "set", port, "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def shape(self, rate: str) -> None:
        """Both directions of every node's link at ``rate``."""
        for i in range(self.nodes):
            for ns, dev in ((self.ns(i), self.dev(i)), (self.switch, self.port(i))):
                sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf(rate))

    def tx_bytes(self) -> int:
        """Bytes the nodes have sent on their links so far (all of them cross the bridge)."""
        total = 0
        for i in range(self.nodes):
            out = sh("ip", "-n", self.ns(i), "-s", "-j", "link", "show", "dev", self.dev(i))
            total += json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"]
        return total

    def close(self) -> None:
        for ns in reversed(self.made):
            sh("ip", "netns", "delete", ns, check=False)
        self.made.clear()


def node_command(cluster: Cluster, node: int, cores: str, torchrun: list[str]) -> list[str]:
    """``torchrun`` in node ``node``'s namespace, on its cores, with a /dev/shm of its own
    (``ip netns exec`` gives each command a mount namespace: the tmpfs is seen by it alone)."""
    script = 'mount -t tmpfs -o size=50% wavelet-node /dev/shm && exec taskset -c "$0" "$@"'
    return ["ip", "netns", "exec", cluster.ns(node), "sh", "-c", script, cores, *torchrun]


def node_cores(nodes: int, per_node: int) -> list[str]:
    available = sorted(os.sched_getaffinity(0))
    if nodes * per_node > len(available):
        print(
            f"note: {nodes} nodes x {per_node} cores > {len(available)} cores here: nodes share",
            flush=True,
        )
    return [
        ",".join(str(available[(n * per_node + k) % len(available)]) for k in range(per_node))
        for n in range(nodes)
    ]


def run_mode(cluster: Cluster, args, mode_name: str, seed: int, run_dir: Path, port: int) -> dict:
    """One mode on every node at once; its figures from the records of all nodes."""
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
    procs = []
    before = cluster.tx_bytes()
    started = time.time()
    try:
        for n in range(cluster.nodes):
            node_dir = run_dir / f"node{n}"
            node_dir.mkdir(parents=True, exist_ok=True)
            torchrun = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(cluster.nodes), "--nproc-per-node", str(mode.processes),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addr(0)}:{port}",
                "--rdzv-id", f"cluster-{cluster.tag}-{port}", "--local-addr", cluster.addr(n),
                "--rdzv-conf", f"is_host={'true' if n == 0 else 'false'}",
                "-m", "wavelet.scripts.cli", "run", *mode.args, "--insecure",
                "--run-dir", str(node_dir), *job,
            ]  # fmt: skip
            log = open(run_dir / f"node{n}.log", "wb")  # noqa: SIM115 (closed below)
            procs.append(
                (
                    subprocess.Popen(
                        node_command(cluster, n, cores[n], torchrun),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                    log,
                )
            )
        deadline = time.monotonic() + args.seconds + args.grace_s
        codes = []
        for proc, _ in procs:
            try:
                codes.append(proc.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            log.close()
    sent = cluster.tx_bytes() - before
    result = {"mode": mode_name, "seed": seed, "run_dir": str(run_dir), "codes": codes}
    if any(c != 0 for c in codes):
        result["error"] = f"exit codes {codes}; see {run_dir}/node*.log"
        return result
    merged = merge_nodes(run_dir, cluster.nodes)
    figures = run_figures(merged, args.target_acc)
    samples = figures.samples_per_s * figures.train_seconds
    summary = json.loads((run_dir / "node0" / "summary.json").read_text())
    result.update(
        samples_per_s=summary.get("samples_per_s", figures.samples_per_s),
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
    )
    return result


def job_lr(config: str | None, extra: list[str]) -> float:
    """The job's learning rate: from ``--lr`` among the extra job flags, else the config file,
    else the default."""
    from wavelet.common.config import JobConfig
    from wavelet.common.settings import from_dict, load_toml

    if "--lr" in extra:
        return float(extra[extra.index("--lr") + 1])
    return from_dict(JobConfig, load_toml(config) if config else {}).optimizer.lr


def shard_apply_ms(run_dir: Path) -> float | None:
    """Median time a shard spent on one push (read, checks, update), from its push records."""
    from wavelet.common.records import read_records

    times = [
        r["apply_s"]
        for path in (run_dir / "records").glob("ps-*-pushes.jsonl")
        for r in read_records(path)
        if "apply_s" in r
    ]
    return 1000 * statistics.median(times) if times else None


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
    for name in ("job.json", "summary.json"):
        if (run_dir / "node0" / name).exists():
            shutil.copy(run_dir / "node0" / name, merged / name)
    return merged


def report(results: list[dict], args) -> str:
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
        base_ttt = [r["time_to_target_s"] for r in base if r["time_to_target_s"] is not None]
        base_ttt_med = statistics.median(base_ttt) if base_ttt else None
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
            vs_ttt = (
                f"{statistics.median(ttt) / base_ttt_med:.2f}x"
                if ttt and base_ttt_med and len(ttt) == len(runs)
                else "-"
            )
            lines.append(
                f"| {mode} | {median_range(sps, 0)} | {vs_sps} | "
                f"{median_range(ttt, 1)} | {len(ttt)}/{len(runs)} | {vs_ttt} | "
                f"{median_range(final, 3)} | {median_range(mb, 3)} | "
                f"{median_range(link, 0)} | {median_range(stale, 2)} | {step} | "
                f"{median_range(apply, 1)} |"
            )
        lines.append("")
    lines += ["Modes:", ""] + [f"- `{m}`: {MODES[m].description}" for m in args.modes]
    return "\n".join(lines) + "\n"


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
    args.batch_size_given = args.batch_size is not None
    if args.batch_size is None:
        args.batch_size = job_batch_size(args.config)
    return args


def job_batch_size(config: str) -> int:
    from wavelet.common.config import JobConfig
    from wavelet.common.settings import from_dict, load_toml

    return (from_dict(JobConfig, load_toml(config)) if config else JobConfig()).batch_size


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_only:  # the same flags as the run, for the report's words
        results = json.loads((Path(args.out) / "results.json").read_text())
        (Path(args.out) / "report.md").write_text(report(results, args))
        print(report(results, args))
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
                    print(f"   {json.dumps({k: v for k, v in r.items() if k != 'step_ms'})}")
                    (out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        cluster.close()
    text = report(results, args)
    (out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
