"""Top-ups under wave turns: which waves of a group have finished their step's batch.

Under wave turns a node done with its batch before the others waits for their pushes, idle. With
``top_up`` a wave done early goes on computing samples on the weights it read and pushes them
with its step (worker/top_up.py), until every wave of its group has finished its batch: it asks
shard 0 with a ``ready`` request, and the answer waits here until each live wave of the group
has said it is ready for that clock too, or has pushed it. A wave that never asks (top-ups off)
counts once it pushes; one that leaves no longer counts. Only shard 0 answers: one shard's word
is enough for when to push, and every shard still waits for every push of the turn.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from wavelet.ps.staleness import ClockTable, WaveId


@dataclass(frozen=True)
class ReadyWait:
    """A ``ready`` request not answered yet."""

    identity: bytes  # the connection to answer on
    request_id: int
    wave: WaveId
    clock: int


class ReadyBoard:
    def __init__(self, group_of: Callable[[WaveId], Hashable]):
        self.group_of = group_of
        self.ready: dict[WaveId, int] = {}  # each wave's latest clock whose batch it finished
        self.waiting: list[ReadyWait] = []

    def declare(self, wave: WaveId, clock: int) -> None:
        self.ready[wave] = max(self.ready.get(wave, -1), clock)

    def group_ready(self, wave: WaveId, clock: int, clocks: ClockTable) -> bool:
        """Every other live wave of ``wave``'s group has finished its batch of ``clock`` or
        pushed it."""
        group = self.group_of(wave)
        for other in clocks.live:
            if other == wave or self.group_of(other) != group:
                continue
            if clocks.clocks[other] <= clock and self.ready.get(other, -1) < clock:
                return False
        return True

    def park(self, wait: ReadyWait) -> None:
        """Keep ``wait`` until its group is ready; a wave's earlier wait is dropped (it asks
        again only once it gave that one up), so the board holds one per wave at most."""
        self.waiting = [w for w in self.waiting if w.wave != wait.wave] + [wait]

    def release(self, clocks: ClockTable) -> list[ReadyWait]:
        """The waits whose group is now ready (taken off the board)."""
        done = [w for w in self.waiting if self.group_ready(w.wave, w.clock, clocks)]
        if done:
            self.waiting = [w for w in self.waiting if w not in done]
        return done

    def forget(self, wave: WaveId) -> list[ReadyWait]:
        """``wave`` left: it no longer counts, and its own waits are returned (to answer)."""
        self.ready.pop(wave, None)
        mine = [w for w in self.waiting if w.wave == wave]
        self.waiting = [w for w in self.waiting if w.wave != wave]
        return mine

    def drain(self) -> list[ReadyWait]:
        out, self.waiting = self.waiting, []
        return out
