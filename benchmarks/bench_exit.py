"""What a process that imported torch spends leaving: the interpreter's own exit against
``exit_now`` (common/process_exit.py), side by side.

    python benchmarks/bench_exit.py              # 7 rounds, about half a minute on 2 cores
    python benchmarks/bench_exit.py --rounds 11 --no-dynamo

Each round, alternating the order, runs a Python that imports torch and torch._dynamo (what a
shard and the fork server hold; ``--no-dynamo``: torch alone, as a worker), computes one small
backward, then ends either way. Reported: the wall time from the script's last line to the
process's exit as its parent sees it, and the CPU the process used in all (its children's
rusage). Medians (range) over rounds; the ratio is exit_now / interpreter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from summarize_updates import median_range  # benchmarks/, beside this script

SCRIPT = """
import sys, time, torch
{dynamo}
torch.nn.Linear(64, 64)(torch.randn(8, 64)).sum().backward()
print(time.time(), flush=True)
if {fast}:
    from wavelet.common.process_exit import exit_now
    exit_now(0)
"""


def one_exit(fast: bool, dynamo: bool) -> tuple[float, float]:
    """(seconds from the script's last line to the exit, CPU seconds of the whole process)."""
    code = SCRIPT.format(dynamo="import torch._dynamo" if dynamo else "", fast=fast)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = os.times()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    out, _ = proc.communicate(timeout=120)
    ended = time.time()
    after = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"the measured Python failed ({proc.returncode})")
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return ended - float(out.split()[-1]), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-dynamo", action="store_true", help="import torch alone")
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for i in range(args.rounds):
        for fast in (False, True) if i % 2 == 0 else (True, False):
            results[fast].append(one_exit(fast, not args.no_dynamo))
    what = "torch" if args.no_dynamo else "torch and torch._dynamo"
    print(f"A Python that imported {what}, {args.rounds} rounds, medians (range):")
    print("| way out | last line to exit, s | CPU of the process, s |")
    print("|---|---:|---:|")
    for fast, name in ((False, "the interpreter's exit"), (True, "exit_now")):
        exits = [e for e, _ in results[fast]]
        cpus = [c for _, c in results[fast]]
        print(f"| {name} | {median_range(exits, 2)} | {median_range(cpus, 2)} |")
    ratio = statistics.median(e for e, _ in results[True]) / statistics.median(
        e for e, _ in results[False]
    )
    print(f"exit_now / interpreter, time to exit: {ratio:.2f}x")


if __name__ == "__main__":
    main()
