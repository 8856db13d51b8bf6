"""Speed-balanced batches: under a synchronous rule every wave of a step waits for the slowest, so
each wave's batch follows its measured speed and the waves of a step finish together (LB-BSP,
SoCC 2020; Cannikin, Middleware 2024). The step still averages over all its samples (the sums
weigh each push by its samples, ``ps/synchronous.py``), so its meaning does not change; only
how the samples are split among the waves does.

Each push says how many samples it carried and how long the wave computed them (forward and
backward, no waiting); the balancer keeps an average of each wave's samples per second and
answers each read with the batch that wave should take next: a group's samples per step (its
waves times the job's batch) shared in proportion to their speeds, each at least 1 and at most
``MAX_FACTOR`` times the job's batch. ``balance_batches = "auto"`` balances only while the
fastest wave of a group is over ``ON_SPREAD`` times the slowest, and stops below
``OFF_SPREAD`` (a co-tenant that comes and goes); ``wavelet stats`` and the summary's update
rule say when it balances, and how far apart the speeds were.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from wavelet.ps.staleness import WaveId

ALPHA = 0.3  # weight of the newest measurement in each wave's average speed
ON_SPREAD = 1.3  # auto: balance once the fastest wave is this much faster than the slowest
OFF_SPREAD = 1.15  # auto: and go back to equal batches below this
MAX_FACTOR = 4  # no wave's batch beyond this many times the job's
MIN_SAMPLES = 3  # measurements of every wave before its speed counts


class BatchBalancer:
    def __init__(self, mode: str, batch_size: int, group_of: Callable[[WaveId], Hashable]):
        self.mode = mode  # on, off, auto
        self.batch_size = batch_size
        self.group_of = group_of
        self.speed: dict[WaveId, float] = {}  # samples per second of compute, averaged
        self.seen: dict[WaveId, int] = {}
        self.active: dict[Hashable, bool] = {}
        self.changes: list[dict] = []  # when auto turned balancing on or off, and why

    def record(self, wave: WaveId, samples: int, compute_s: float) -> None:
        """A push of ``samples`` computed in ``compute_s`` seconds (0: not measured)."""
        if samples <= 0 or compute_s <= 0:  # kept even when off: placement reads the speeds
            return
        rate = samples / compute_s
        old = self.speed.get(wave)
        self.speed[wave] = rate if old is None else (1 - ALPHA) * old + ALPHA * rate
        self.seen[wave] = self.seen.get(wave, 0) + 1

    def forget(self, wave: WaveId) -> None:
        self.speed.pop(wave, None)
        self.seen.pop(wave, None)

    def batch_for(self, wave: WaveId, live: set[WaveId]) -> int:
        """The batch ``wave`` should take next (0: the job's, unchanged)."""
        if self.mode == "off":
            return 0
        group = self.group_of(wave)
        members = [w for w in live if self.group_of(w) == group]
        if len(members) < 2 or any(self.seen.get(w, 0) < MIN_SAMPLES for w in members):
            return 0
        speeds = {w: self.speed[w] for w in members}
        if not self._balancing(group, speeds):
            return 0
        total = self.batch_size * len(members)
        share = speeds[wave] / sum(speeds.values())
        return int(min(max(1, round(total * share)), MAX_FACTOR * self.batch_size))

    def _balancing(self, group: Hashable, speeds: dict[WaveId, float]) -> bool:
        if self.mode == "on":
            return True
        spread = max(speeds.values()) / max(min(speeds.values()), 1e-12)
        was = self.active.get(group, False)
        now = spread > ON_SPREAD if not was else spread > OFF_SPREAD
        if now != was:
            self.active[group] = now
            change = {"t": time.time(), "group": str(group), "on": now, "spread": spread}
            self.changes.append(change)
        return now

    def describe(self) -> str:
        """What the balancer does now, for ``wavelet stats`` and the summary."""
        if self.mode == "off":
            return ""
        if self.mode == "on":
            return "balanced batches"
        if not any(self.active.values()):
            return ""  # equal batches: the waves' speeds are within ON_SPREAD
        last = self.changes[-1]
        return f"balanced batches (speeds {last['spread']:.1f}x apart)"
