"""ForwardBaton: the waves of one device take turns at their memory-heavy forward passes.

A wave may start a forward only while it holds the baton, and passes it to the next wave when it
calls ``release``; backward, push and pull need no baton. The wave decides when: by default during
its backward, once all but ``baton_handoff`` (0.3) of its forward's saved activations are freed
(worker/wave.py), or at the end of its forward with ``baton_handoff = 1.0``, as in the paper.
Turns go tick, tock, tick, ... so tock's first forward starts half a cycle after tick's: that is
the offset. Forwards never overlap. A wave whose turn it is but which does not come for
``timeout_s`` (dead or stalled) loses its turn, and the others go on without it. Under wave turns
the shards decide which wave steps first (a resumed job goes on with the group whose turn it
was): there the first wave to ask takes the first turn (``first=None``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# How often a wave waiting for the baton does what it may meanwhile (take in its weights still
# on their way, and follow a shard that moved: worker/rounds.py, PendingPull.take_arrived).
MEANWHILE_EVERY_S = 0.01


class ForwardBaton:
    def __init__(self, waves: int, timeout_s: float = 30.0, first: int | None = 0):
        self._cond = threading.Condition()
        self._order = list(range(waves))
        self._active = set(self._order)
        self._turn: int | None = first  # None: whoever asks first
        self._holder: int | None = None
        self.timeout_s = timeout_s

    def acquire(self, wave: int, meanwhile: Callable[[], None] | None = None) -> float:
        """Block until it is ``wave``'s turn and no forward runs; returns the seconds waited.
        ``meanwhile`` is called every ``MEANWHILE_EVERY_S`` of the wait, outside the lock."""
        start = time.monotonic()
        while True:
            with self._cond:
                if self._wait_turn(wave, start, MEANWHILE_EVERY_S if meanwhile else None):
                    self._holder = wave
                    self._turn = wave
                    return time.monotonic() - start
            meanwhile()

    def _wait_turn(self, wave: int, start: float, for_s: float | None) -> bool:
        """Wait (at most ``for_s``; None: as long as it takes) until ``wave`` may take the baton
        (called holding the lock); whether it may."""
        until = None if for_s is None else time.monotonic() + for_s
        while not (self._holder is None and self._turn in (None, wave)):
            now = time.monotonic()
            waited = now - start
            if self._holder is None and waited >= self.timeout_s:
                log.warning("wave %d skipped stalled wave %d's turn to forward", wave, self._turn)
                return True
            if until is not None and now >= until:
                return False
            # free but not our turn: until the stalled wave loses it; held: until notified
            timeout = self.timeout_s if self._holder is not None else self.timeout_s - waited
            self._cond.wait(max(0.001, timeout if until is None else min(timeout, until - now)))
        return True

    def release(self, wave: int) -> None:
        with self._cond:
            if self._holder == wave:
                self._holder = None
                self._turn = self._next(wave)
                self._cond.notify_all()

    def leave(self, wave: int) -> None:
        """``wave`` is done (or failed): the others stop waiting for its turns."""
        with self._cond:
            self._active.discard(wave)
            if self._holder == wave:
                self._holder = None
            if self._turn == wave:
                self._turn = self._next(wave)
            self._cond.notify_all()

    def _next(self, wave: int) -> int:
        n = len(self._order)
        for step in range(1, n + 1):
            candidate = self._order[(wave + step) % n]
            if candidate in self._active:
                return candidate
        return wave


class NoBaton:
    """Waves started together: forwards may overlap (the baseline tick-tock is compared with)."""

    def acquire(self, wave: int, meanwhile: Callable[[], None] | None = None) -> float:
        return 0.0

    def release(self, wave: int) -> None:
        pass

    def leave(self, wave: int) -> None:
        pass
