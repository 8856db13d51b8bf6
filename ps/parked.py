"""Pulls a shard holds back until the staleness bound lets them read, and their release."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from wavelet.common.protocol import ErrorCode, ProtocolError, error_header
from wavelet.ps.datapath import Outgoing
from wavelet.ps.staleness import WaveId


@dataclass
class ParkedPull:
    peer: bytes
    request_id: int
    wave: WaveId
    clock: int
    since: float
    action: str = ""  # what became of the push that came with this pull
    shm: bool = False  # answer through the wave's pull segment
    part_bytes: int = 0  # answer in parts of about this many bytes (0: one message)


class ParkedPulls:
    """At most ``limit`` parked pulls; each is answered once: with weights or with an error."""

    def __init__(self, limit: int):
        self.limit = limit
        self.pulls: list[ParkedPull] = []

    def __len__(self) -> int:
        return len(self.pulls)

    def check_room(self) -> None:
        """Refuse (before anything changes) a request that might have to park, when full."""
        if len(self.pulls) >= self.limit:
            raise ProtocolError(
                ErrorCode.LIMIT,
                f"{len(self.pulls)} pulls are parked already, "
                "the most this shard holds (max_parked)",
            )

    def park(
        self, peer: bytes, request_id: int, wave: WaveId, clock: int, action, shm, part_bytes=0
    ) -> None:
        self.pulls.append(
            ParkedPull(peer, request_id, wave, clock, time.monotonic(), action, shm, part_bytes)
        )

    def release(
        self,
        may_read: Callable[[WaveId, int], bool],
        serve: Callable[[ParkedPull, float], list[Outgoing]],
    ) -> list[Outgoing]:
        """Serve every pull whose clock may now read: ``serve(pull, seconds_parked)`` gives its
        answer (weights, or an error for that pull alone)."""
        ready = [p for p in self.pulls if may_read(p.wave, p.clock)]
        out = [m for p in ready for m in serve(p, time.monotonic() - p.since)]
        # only now: if serving raised, every pull is still here for the caller to answer
        self.pulls = [p for p in self.pulls if p not in ready]
        return out

    def answer(
        self, which: Callable[[ParkedPull], bool], code: ErrorCode, message: str
    ) -> list[Outgoing]:
        """Answer the parked pulls ``which(pull)`` selects with an error, and forget them."""
        hit = [p for p in self.pulls if which(p)]
        self.pulls = [p for p in self.pulls if not which(p)]
        return [Outgoing(p.peer, error_header(p.request_id, code, message)) for p in hit]
