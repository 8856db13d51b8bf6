"""Benchmark: what a shard checkpoint costs, beside writing the same bytes raw, in one run.

A shard holding 11M float32 parameters (44 MB, ResNet-18's size) with SGD momentum state (another
44 MB) writes its checkpoint (torch.save, fsync, rename, fsync of the folder); the baseline writes
the same number of bytes with one write and an fsync. Medians over repeats, alternating.

Run: ``python benchmarks/bench_checkpoint.py`` (``--help`` for sizes and repeats).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from wavelet.common.optimizer import OptimizerConfig
from wavelet.ps.checkpoints import write_checkpoint
from wavelet.ps.shard import Shard


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=11_000_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shard = Shard(OptimizerConfig())
    chunk = 1 << 20
    values = list(torch.randn(args.numel).split(chunk))
    shard.initialize("bench", list(range(len(values))), values, [True] * len(values))
    shard.apply({k: torch.randn_like(v) * 1e-3 for k, v in enumerate(values)})  # momentum state
    state = shard.state_dict()
    nbytes = 2 * args.numel * 4
    raw = os.urandom(1 << 20) * (nbytes >> 20)
    ckpt_t, raw_t = [], []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for _ in range(args.repeats):
            t = time.perf_counter()
            write_checkpoint(Path(tmp) / "shard-0.pt", state)
            ckpt_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            with open(Path(tmp) / "raw.bin", "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            raw_t.append(time.perf_counter() - t)
        size = (Path(tmp) / "shard-0.pt").stat().st_size
    c, r = statistics.median(ckpt_t), statistics.median(raw_t)
    print(
        f"\n{args.numel:,} float32 parameters + momentum ({size / 1e6:.0f} MB on disk), "
        f"medians of {args.repeats}\n"
    )
    print("| write | median ms | MB/s | vs raw write |")
    print("|---|---:|---:|---:|")
    print(
        f"| shard checkpoint (torch.save + fsync + rename) | {1000 * c:.0f} | "
        f"{size / c / 1e6:.0f} | {c / r:.2f}x |"
    )
    print(f"| raw write + fsync, same bytes | {1000 * r:.0f} | {nbytes / r / 1e6:.0f} | 1.00x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
