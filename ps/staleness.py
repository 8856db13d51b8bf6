"""Clocks of the live waves, the staleness bound on reads, and per-wave staleness statistics.

A wave's clock is the number of iterations it has pushed. Under bound ``s`` a wave at clock ``c``
may read only when every live wave has reached clock ``c - s`` (stale synchronous parallel):
``s = 0`` is bulk-synchronous, ``s = inf`` fully asynchronous.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

WaveId = tuple[str, int]  # (worker, wave index within that worker)


class ClockTable:
    """Clocks of the waves that have registered; only live ones count towards the bound."""

    def __init__(self) -> None:
        self.clocks: dict[WaveId, int] = {}
        self.live: set[WaveId] = set()
        self.last_seen: dict[WaveId, float] = {}

    def join(self, wave: WaveId, clock: int) -> None:
        self.clocks[wave] = clock
        self.live.add(wave)
        self.seen(wave)

    def seen(self, wave: WaveId) -> None:
        self.last_seen[wave] = time.monotonic()

    def silent(self, timeout_s: float, now: float | None = None) -> list[WaveId]:
        """Live waves not heard from for ``timeout_s`` (by ``now``, monotonic seconds)."""
        now = time.monotonic() if now is None else now
        return [w for w in self.live if now - self.last_seen.get(w, now) > timeout_s]

    def credit(self, seconds: float) -> None:
        """The shard itself did not run for ``seconds`` (stopped, starved of CPU, one long
        request): no live wave's silence counts that time, since nothing was read."""
        now = time.monotonic()
        for w in self.live:
            if w in self.last_seen:
                self.last_seen[w] = min(now, self.last_seen[w] + seconds)

    def leave(self, wave: WaveId) -> None:
        self.live.discard(wave)

    def forget(self, wave: WaveId) -> None:
        """Remove every trace of ``wave`` (it left and its slot is needed)."""
        self.leave(wave)
        self.clocks.pop(wave, None)
        self.last_seen.pop(wave, None)

    def advance(self, wave: WaveId) -> int:
        self.clocks[wave] += 1
        return self.clocks[wave]

    def min_live_clock(self) -> int | None:
        return min((self.clocks[w] for w in self.live), default=None)


@dataclass(frozen=True)
class StalenessBound:
    s: float  # whole number >= 0, or inf

    @property
    def synchronous(self) -> bool:
        return self.s == 0

    def may_read(self, clock: int, table: ClockTable) -> bool:
        if math.isinf(self.s):
            return True
        slowest = table.min_live_clock()
        return slowest is None or slowest >= clock - self.s


@dataclass
class WaveStats:
    """What a shard saw of one wave: pushes, staleness histogram, versions read, parking."""

    pushes: int = 0
    staleness: Counter = field(default_factory=Counter)
    reads: deque = field(default_factory=lambda: deque(maxlen=64))  # (clock, version) recent
    reads_total: int = 0
    parked: int = 0
    parked_s: float = 0.0
    dropped: int = 0
    skipped: int = 0  # steps the wave skipped (fp16 overflow): its clock passed, no gradient
    rejected: Counter = field(default_factory=Counter)
    transport: str = "tcp"  # how its tensors travel: tcp (frames) or shm (segments)

    def record_push(self, tau: int) -> None:
        self.pushes += 1
        self.staleness[tau] += 1

    def record_read(self, clock: int, version: int) -> None:
        self.reads.append((clock, version))
        self.reads_total += 1

    def summary(self) -> dict[str, Any]:
        total = sum(self.staleness.values())
        mean = sum(t * n for t, n in self.staleness.items()) / total if total else 0.0
        return {
            "pushes": self.pushes,
            "staleness_hist": {str(t): n for t, n in sorted(self.staleness.items())},
            "staleness_mean": mean,
            "staleness_max": max(self.staleness, default=0),
            "reads": [list(r) for r in self.reads],
            "reads_total": self.reads_total,
            "parked": self.parked,
            "parked_s": self.parked_s,
            "dropped": self.dropped,
            "skipped": self.skipped,
            "rejected": dict(self.rejected),
            "transport": self.transport,
        }
