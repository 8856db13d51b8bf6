"""``wavelet stats``: what live shards know of every wave (clock, versions read, staleness)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from wavelet.common.figures import quantile
from wavelet.common.protocol import Op, ShardError
from wavelet.common.security import JobKeys
from wavelet.common.settings import ConfigError
from wavelet.worker.connection import call_shard


def fetch_stats(addresses: list[str], timeout_s: float = 5.0, keys=None) -> list[dict]:
    return [call_shard(a, Op.STATS, timeout_s, keys=keys).body for a in addresses]


def fetch_one(address: str, timeout_s: float = 2.0, keys=None) -> dict | None:
    """One shard's statistics, or None if it does not answer (gone, or not yet up)."""
    try:
        return call_shard(address, Op.STATS, timeout_s, keys=keys).body
    except ShardError:
        return None


def merge_wave_stats(shards: list[dict]) -> dict[str, dict]:
    """Per wave, over all shards: pushes and parking summed, staleness histograms added up."""
    waves: dict[str, dict] = {}
    for shard in shards:
        for name, w in shard["waves"].items():
            m = waves.setdefault(
                name,
                {
                    "clock": 0,
                    "pushes": 0,
                    "hist": {},
                    "parked": 0,
                    "parked_s": 0.0,
                    "last_read": {},
                    "rejected": 0,
                    "dropped": 0,
                    "skipped": 0,
                    "transports": set(),
                },
            )
            m["clock"] = max(m["clock"], w["clock"])
            m["pushes"] += w["pushes"]
            m["parked"] += w["parked"]
            m["parked_s"] = max(m["parked_s"], w["parked_s"])
            m["rejected"] += sum(w["rejected"].values())
            m["dropped"] += w["dropped"]
            m["skipped"] = max(m["skipped"], w.get("skipped", 0))  # every shard saw each skip
            m["transports"].add(w.get("transport", "tcp"))
            for tau, n in w["staleness_hist"].items():
                m["hist"][int(tau)] = m["hist"].get(int(tau), 0) + n
            if w["reads"]:
                m["last_read"][shard["shard"]] = w["reads"][-1][1]
    for m in waves.values():
        m["transport"] = "+".join(sorted(m.pop("transports")))
        total = sum(m["hist"].values())
        m["staleness_mean"] = sum(t * n for t, n in m["hist"].items()) / total if total else 0.0
        m["staleness_max"] = max(m["hist"], default=0)
        m["staleness_p99"] = quantile(m["hist"], 0.99)
    return waves


def format_wave_table(waves: dict[str, dict]) -> str:
    lines = [
        f"{'wave':<8} {'clock':>6} {'read':>10} {'pushes':>7} {'mean':>6} {'p99':>4} "
        f"{'max':>4} {'dropped':>7} {'skipped':>7} {'parked':>7} {'waited_s':>9} {'via':>7}  "
        "staleness histogram (staleness:pushes)"
    ]
    for name in sorted(waves):
        w = waves[name]
        hist = " ".join(f"{t}:{n}" for t, n in sorted(w["hist"].items()))
        read = "/".join(str(v) for _, v in sorted(w["last_read"].items())) or "-"
        lines.append(
            f"{name:<8} {w['clock']:>6} {read:>10} {w['pushes']:>7} {w['staleness_mean']:>6.2f} "
            f"{w['staleness_p99']:>4} {w['staleness_max']:>4} {w['dropped']:>7} "
            f"{w.get('skipped', 0):>7} {w['parked']:>7} "
            f"{w['parked_s']:>9.2f} {w.get('transport', 'tcp'):>7}  {hist}"
        )
    return "\n".join(lines)


def print_stats(addresses: list[str], timeout_s: float = 5.0, keys=None) -> int:
    try:
        shards = fetch_stats(addresses, timeout_s, keys)
    except ShardError as e:
        print(f"wavelet stats: {e}", file=sys.stderr)
        return 1
    for s in shards:
        reads = s.get("shm_reads") or {}
        in_shm = (
            f", shared-memory pulls: {reads.get('into_wave', 0)} written into the wave's memory, "
            f"{reads['in_place']} read in place, {reads['copied']} copied, weights moved "
            f"{reads['slot_moves']}x"
            if reads.get("into_wave") or reads.get("in_place") or reads.get("copied")
            else ""
        )
        print(
            f"shard {s['shard']}: version {s['version']}, {s['update_rule']}, "
            + (f"{s['batches']}, " if s.get("batches") else "")
            + f"{s['parked_now']} pull(s) parked, {s['rejected']} request(s) rejected{in_shm}"
        )
    print(format_wave_table(merge_wave_stats(shards)))
    print(
        "read: version last read from each shard; mean/p99/max: staleness of pushes; "
        "skipped: steps the wave skipped on fp16 overflow; "
        "waited_s: time pulls were parked by the bound or the turn order; via: how its tensors "
        "travel (shm: shared memory, tcp: ZeroMQ frames)"
    )
    return 0


def run_dir_shards(run_dir: Path):
    """The shard addresses a ``wavelet launch`` run dir records (``ps-<i>.addr``, written as each
    shard starts listening), and the launcher's CURVE keys if the job has them."""
    found = sorted(
        (p for p in run_dir.glob("ps-*.addr") if p.stem.split("-")[1].isdigit()),
        key=lambda p: int(p.stem.split("-")[1]),
    )
    if not found:
        raise ConfigError(f"{run_dir} records no shard addresses (ps-<i>.addr): not a PS run dir?")
    keys = JobKeys(run_dir / "keys").client("launcher") if (run_dir / "keys").is_dir() else None
    addresses = []
    for p in found:
        try:
            addresses.append(p.read_text().strip())
        except (OSError, UnicodeDecodeError):
            raise ConfigError(f"{p} holds no shard address; is {run_dir} a run dir?") from None
    return addresses, keys


def watch(addresses: list[str], every_s: float, timeout_s: float = 5.0, keys=None) -> int:
    """Print the table every ``every_s`` seconds until Ctrl-C (exit 0) or the shards stop
    answering (exit 1)."""
    try:
        while True:
            print("\033[H\033[J" + time.strftime("%H:%M:%S"), flush=True)  # clear, then redraw
            if print_stats(addresses, timeout_s, keys) != 0:
                return 1
            time.sleep(every_s)
    except KeyboardInterrupt:
        return 0
