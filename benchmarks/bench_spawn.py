"""How long a daemon takes to start, exec'd or forked from the fork server, side by side.

    python benchmarks/bench_spawn.py             # 5 rounds, about 2 minutes on 2 cores
    python benchmarks/bench_spawn.py --rounds 9 --job-epochs 1

Each round, alternating the order, starts one shard (`wavelet ps`) both ways and times it from
the request to its address file (ready to serve), with the CPU the shard process used by then
(/proc/PID/stat), then stops it. The fork server's own start, paid once per job, is reported
beside it. With --job-epochs N it also runs a whole default job (`wavelet launch --shards 2`)
each way and reports its wall time and the CPU of the launcher and everything it started.
Medians (range) over rounds; ratios are fork / exec.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from summarize_updates import median_range  # benchmarks/, beside this script

from wavelet.scripts.forkserver import ForkServer

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def _shard_args(folder: Path) -> tuple[list[str], Path]:
    ready = folder / "ps-0.addr"
    args = ["ps", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready)]
    return [*args, "--run-dir", str(folder)], ready


def _until_ready(proc, ready: Path, started: float) -> tuple[float, float]:
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the shard exited with status {proc.poll()}")
        if time.perf_counter() - started > 120:
            raise RuntimeError("the shard did not start within 120 s")
        time.sleep(0.005)
    took = time.perf_counter() - started
    cpu = _cpu_s(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    return took, cpu


def shard_exec(folder: Path, env: dict[str, str]) -> tuple[float, float]:
    args, ready = _shard_args(folder)
    started = time.perf_counter()
    with open(folder / "ps.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "wavelet.scripts.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return _until_ready(proc, ready, started)


def shard_fork(folder: Path, env: dict[str, str], server: ForkServer) -> tuple[float, float]:
    args, ready = _shard_args(folder)
    started = time.perf_counter()
    proc = server.spawn(args, env, folder / "ps.log", append=False)
    return _until_ready(proc, ready, started)


def job(folder: Path, env: dict[str, str], spawn: str, epochs: int) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "wavelet.scripts.cli", "launch", "--shards", "2"]
        + ["--epochs", str(epochs), "--spawn", spawn, "--run-dir", str(folder / "run")],
        env=env,
        capture_output=True,
        text=True,
    )
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the {spawn} job failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return took, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--job-epochs", type=int, default=0, help="also time whole jobs (0: no)")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-spawn-") as tmp:
        root = Path(tmp)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        server = ForkServer.start(root / "forkserver.log", env=env)
        server_s = time.perf_counter() - started
        server_cpu = _cpu_s(server.proc.pid)
        try:
            for r in range(args.rounds):
                ways = [("exec", None), ("fork", server)]
                for way, srv in ways if r % 2 == 0 else ways[::-1]:
                    folder = root / f"{way}-{r}"
                    folder.mkdir()
                    measured = (
                        shard_exec(folder, env) if srv is None else shard_fork(folder, env, srv)
                    )
                    results.setdefault(f"shard {way}", []).append(measured)
                    if args.job_epochs:
                        results.setdefault(f"job {way}", []).append(
                            job(folder, env, way, args.job_epochs)
                        )
        finally:
            server.close()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{args.rounds} rounds, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    print(f"fork server start (once per job): {server_s:.2f} s, {server_cpu:.2f} s of CPU")
    print("| what | way | wall s: median (range) | CPU s: median (range) |")
    print("|---|---|---|---|")
    for name, values in results.items():
        what, way = name.split()
        walls, cpus = [v[0] for v in values], [v[1] for v in values]
        print(f"| {what} | {way} | {median_range(walls, 2)} | {median_range(cpus, 2)} |")
    for what in ("shard", "job"):
        if f"{what} exec" in results:
            pairs = list(zip(results[f"{what} fork"], results[f"{what} exec"], strict=True))
            wall = statistics.median(f[0] / e[0] for f, e in pairs)
            cpu = statistics.median(f[1] / e[1] for f, e in pairs)
            print(
                f"{what}, fork / exec: wall {wall:.2f}x, CPU {cpu:.2f}x "
                "(medians of the rounds' ratios)"
            )
    total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"(all processes started: {total:.0f} s of CPU, the fork server's included)")


if __name__ == "__main__":
    main()
