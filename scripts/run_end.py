"""The end of a job under torchrun (``wavelet run``): worker 0 waits for the other workers,
however late, but not for those the job lost, and sums what every node trained.

Each node keeps its records in its own run dir, so workers publish their samples and seconds
in torchrun's key-value store. A worker whose node was lost (killed, preempted and gone) never
writes its keys: worker 0 asks the shards, and a worker none of whose waves is a member any more
(docs/faults.md) is not waited for once ``GONE_GRACE_S`` passed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

GONE_GRACE_S = 5.0  # a worker whose waves all left writes its keys within this, if it lives


def wait_for_workers(
    store,
    keys: dict[int, str],
    note_every_s: float = 300.0,
    say=lambda text: print(text, flush=True),
    members: Callable[[], set[int] | None] | None = None,
) -> list[int]:
    """Wait for every worker's done key (``keys``: rank -> key), however late: a straggler is
    slow, not failed. Says every few minutes whom it still waits for, instead of timing out with
    a traceback. ``members()``: the ranks that still have a wave in the job (None: unknown);
    a rank that has none for ``GONE_GRACE_S`` is given up. Returns the ranks given up."""
    last_note = time.monotonic()
    left_at: dict[int, float] = {}
    gone: list[int] = []
    while True:
        missing = [r for r, k in keys.items() if r not in gone and not store.check([k])]
        if not missing:
            return gone
        now = time.monotonic()
        alive = members() if members is not None else None
        for rank in missing:
            if alive is None or rank in alive:
                left_at.pop(rank, None)
            elif now - left_at.setdefault(rank, now) > GONE_GRACE_S:
                gone.append(rank)
                say(f"wavelet run: worker {rank} left the job; not waiting for it")
        if now - last_note >= note_every_s:
            say(f"wavelet run: still waiting for worker(s) {', '.join(map(str, missing))}")
            last_note = now
        time.sleep(0.5)


def publish_throughput(store, key: str, run_dir: Path, rank: int) -> None:
    """This worker's samples and seconds of training, from its own records, for worker 0's
    summary: each node keeps its records in its own run dir, so only the store sees the job."""
    from wavelet.common.records import read_records

    samples, first, last = 0, None, None
    for path in (run_dir / "records").glob(f"worker-{rank}-wave-*.jsonl"):
        for r in read_records(path):
            if r["kind"] == "start":
                first = r["t"] if first is None else min(first, r["t"])
            elif r["kind"] == "step":
                samples += r["samples"]
                last = r["t"] if last is None else max(last, r["t"])
    seconds = (last - first) if first is not None and last is not None else 0.0
    store.set(key, json.dumps({"samples": samples, "seconds": seconds}))


def job_throughput(store, keys: list[str], lost: int = 0) -> dict:
    """Samples and samples/s of the whole job: each worker's rate over its own span, summed (no
    node's clock is compared with another's); ``lost`` workers published nothing."""
    store.wait(keys)
    parts = [json.loads(store.get(k)) for k in keys]
    return {
        "samples": sum(p["samples"] for p in parts),
        "samples_per_s": sum(p["samples"] / p["seconds"] for p in parts if p["seconds"] > 0),
        "train_seconds": max((p["seconds"] for p in parts), default=0.0),
        "workers": len(parts),
        "workers_lost": lost,
    }


def member_ranks(addresses: list[str], keys=None) -> set[int] | None:
    """The worker ranks with a live wave on any shard that answers (None: none answered)."""
    from wavelet.scripts.stats import fetch_one

    ranks: set[int] = set()
    answered = False
    for address in addresses:
        stats = fetch_one(address, keys=keys)
        if stats is None:
            continue
        answered = True
        for name, wave in stats.get("waves", {}).items():
            if wave.get("live") and name.startswith("w"):
                ranks.add(int(name[1:].split("/")[0]))
    return ranks if answered else None
