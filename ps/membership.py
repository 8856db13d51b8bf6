"""Which waves a shard serves: their clocks, who owns each, what the shard saw of each.

A wave registers (taking a clock and binding to its connection), is kept alive by any request or
heartbeat, and leaves, is dropped for silence, or is forgotten to make room for a new one. The
staleness bound (``ps/staleness.py``) reads the clocks of the live waves kept here.
"""

from __future__ import annotations

import time
from typing import Any

from wavelet.common.protocol import ErrorCode, Header, ProtocolError, wave_name
from wavelet.ps.owners import Peer, WaveOwners
from wavelet.ps.staleness import ClockTable, WaveId, WaveStats

SLOT_HOLD_S = 30.0  # a worker slot given to a joiner is not given again for this long


class Membership:
    def __init__(self, max_waves: int):
        self.max_waves = max_waves
        self.clocks = ClockTable()
        self.owners = WaveOwners()
        self.stats: dict[WaveId, WaveStats] = {}
        self._slots_given: dict[int, float] = {}  # worker ranks told to joiners, and when
        # the membership epoch: bumped at every join and every leave (docs/faults.md)
        self.epoch = 0
        self.joins = 0
        self.leaves = 0
        self.on_change = None  # called with (kind, wave, why) after each change: the records

    def restore(self, wave: WaveId, clock: int) -> None:
        """A wave a checkpoint knew: its clock is kept, but it registers again before use."""
        self.clocks.join(wave, clock)
        self.stats.setdefault(wave, WaveStats())

    def restore_clocks(self, clocks: list[list], lease_s: float, timeout_s: float) -> None:
        """The waves a standby's primary knew, [worker, wave, clock, live] each: their clocks
        are kept; a live one counts as live for ``lease_s`` more unless it registers (a wave
        is dropped once silent for ``timeout_s``)."""
        now = time.monotonic()
        for worker, index, clock, live in clocks:
            wave = (str(worker), int(index))
            self.stats.setdefault(wave, WaveStats())
            if live:
                self.clocks.join(wave, int(clock))
                self.clocks.last_seen[wave] = now - timeout_s + lease_s
            else:
                self.clocks.clocks[wave] = int(clock)

    def register(self, peer: Peer, h: Header, resume: bool, exact: bool) -> tuple[WaveId, int]:
        """``h``'s wave joins (or re-joins) on ``peer``'s connection; returns it and its clock."""
        wave = wave_of(h)
        if wave not in self.clocks.clocks:
            self._make_room()
        self.owners.claim(wave, peer)  # refused while another open connection owns it
        if resume and wave in self.clocks.clocks:
            clock = self.clocks.clocks[wave]  # a resumed job goes on where it stopped
        elif exact:
            clock = max(h.clock, 0)  # a wave re-joining at the clock it has on other shards
        else:
            # A wave that (re)joins a running job starts at the slowest live wave's clock, so
            # it does not hold the others back under the staleness bound.
            others = [
                c for w, c in self.clocks.clocks.items() if w in self.clocks.live and w != wave
            ]
            clock = max(h.clock, min(others, default=0), 0)
        was_live = wave in self.clocks.live
        self.clocks.join(wave, clock)
        self.stats.setdefault(wave, WaveStats())
        if not was_live:
            self._changed("join", wave, f"at clock {clock}")
        return wave, clock

    def registered(self, h: Header, peer: Peer) -> WaveId:
        """The wave ``h`` names, registered here by ``peer``'s connection (else refused)."""
        wave = wave_of(h)
        if wave not in self.clocks.clocks:
            raise ProtocolError(
                ErrorCode.NOT_REGISTERED,
                f"wave {wave_name(*wave)} has not registered with this shard",
            )
        self.owners.check(wave, peer)
        if wave in self.clocks.live:
            self.clocks.seen(wave)  # any request is a sign of life
        return wave

    def free_slot(self, expected_workers: int) -> tuple[int, int]:
        """A worker rank for a joiner, and the worker count its data part is taken of: the
        lowest rank whose waves all left (its part of the data goes on being read), else a new
        rank past every one known (a part of its own of one more worker: it overlaps others').
        A rank handed out is kept for ``SLOT_HOLD_S`` for its worker to register."""
        now = time.monotonic()
        self._slots_given = {r: t for r, t in self._slots_given.items() if now - t < SLOT_HOLD_S}
        live = {_rank(w) for w in self.clocks.live} - {None}
        known = {_rank(w) for w in self.clocks.clocks} - {None}
        taken = live | set(self._slots_given)
        for rank in range(expected_workers):
            if rank not in taken:
                break
        else:
            rank = max(known | taken | {expected_workers - 1}) + 1
        self._slots_given[rank] = now
        return rank, max(expected_workers, rank + 1)

    def heartbeat(self, worker: str, waves: list[int]) -> None:
        for index in waves:
            wave = (worker, index)
            # only a wave whose registering connection is still open is kept alive this way
            if wave in self.clocks.live and self.owners.bound(wave):
                self.clocks.seen(wave)

    def leave(self, wave: WaveId, why: str = "") -> None:
        was_live = wave in self.clocks.live
        self.clocks.leave(wave)
        self.owners.release(wave)
        if was_live:
            self._changed("leave", wave, why)

    def _changed(self, kind: str, wave: WaveId, why: str) -> None:
        self.epoch += 1
        if kind == "join":
            self.joins += 1
        else:
            self.leaves += 1
        if self.on_change is not None:
            self.on_change(kind, wave, why)

    def summary(self) -> dict[str, int]:
        """The membership in numbers, for stats, the summary and the metrics."""
        return {
            "epoch": self.epoch,
            "live": len(self.clocks.live),
            "joins": self.joins,
            "leaves": self.leaves,
        }

    def count_rejection(self, header: Header | None, code: str) -> None:
        if header is not None and header.worker and header.wave >= 0:
            wave = (header.worker, header.wave)
            if wave in self.stats:
                self.stats[wave].rejected[str(code)] += 1

    def table(self) -> dict[str, dict[str, Any]]:
        """Per wave, by name: its clock, whether it is live, and what the shard saw of it."""
        return {
            wave_name(*wave): {
                "clock": self.clocks.clocks.get(wave, 0),
                "live": wave in self.clocks.live,
                **st.summary(),
            }
            for wave, st in self.stats.items()
        }

    def _make_room(self) -> None:
        """A new wave may register while fewer than ``max_waves`` are known; waves that left or
        were dropped (and are not connected) are forgotten first to make room."""
        if len(self.clocks.clocks) < self.max_waves:
            return
        for wave in [w for w in self.clocks.clocks if w not in self.clocks.live]:
            if not self.owners.bound(wave):
                self.clocks.forget(wave)
                self.stats.pop(wave, None)
                self.owners.forget(wave)
                if len(self.clocks.clocks) < self.max_waves:
                    return
        raise ProtocolError(
            ErrorCode.LIMIT,
            f"this shard serves at most {self.max_waves} waves (max_waves) and that many are "
            "registered",
        )


def _rank(wave: WaveId) -> int | None:
    """The worker rank of a wave named as workers name theirs (``w<rank>``), else None."""
    worker = wave[0]
    return int(worker[1:]) if worker[:1] == "w" and worker[1:].isdigit() else None


def wave_of(h: Header) -> WaveId:
    if not h.worker or h.wave < 0:
        raise ProtocolError(ErrorCode.MALFORMED, "request needs worker and wave (>= 0)")
    return (h.worker, h.wave)
