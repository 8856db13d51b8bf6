"""Synchronous updates: the gradients of one clock averaged into one update, per group of waves.

Two ways to group the waves of a job:

- bulk-synchronous (``staleness = 0``): one group, every wave. Every gradient of a clock was
  computed from the same version, so their mean is one update that equals single-process training
  on the concatenated batches.
- wave groups (``updates = "wave-groups"``, the MLSys 2021 design): the waves with the same local
  index on every device form a group (tick: wave 0 of every worker, tock: wave 1). Each group
  averages its gradients of a clock into one update, as data-parallel tasks do; the groups take
  turns on the same shards, half a cycle apart, so each group's update lands between two of the
  other's and every update after the first is exactly one group-step stale.
- wave turns (``updates = "wave-turns"``): the same groups in strict turns, each reading the
  update the other group just made, so no update is stale. A group's forward then waits for the
  other's update instead of overlapping its backward: what a device that computes one wave at a
  time (a CPU, worker/compute.py) does anyway.

A group's sum for clock ``c`` is applied once every live wave of that group has pushed ``c``; until
then a wave of the group may not read (its next forward must see its group's update). With
``patience`` (wave groups and turns) it is also applied once the waves that pushed have waited
that many times the group's usual turn (from one of its updates to the next) for the rest: a
node slowed all at once (a co-tenant's cap coming on) holds every node back for the step it is
in, before balanced batches follow from its push (``ps/balance.py``); its late push is folded
into the group's next update, as k of n folds one. Wave groups
also keep the turns in order (``in_turn``): group g reads clock c once every earlier group has
pushed c - 1 and every later group c - 2, which is the tick-tock timeline (tick c reads before
tock's update c - 1 lands, tock c after tick's update c - 1). Wave turns shift both by one
(``turn_delay`` 0): earlier groups must have pushed c, later ones c - 1.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch

from wavelet.common.protocol import ErrorCode, ProtocolError, check_type
from wavelet.ps.staleness import ClockTable, WaveId


class SyncSum:
    """The open clock of one group: the sum of its gradients and their count. A wave that
    skipped its step (fp16 overflow) counts as having pushed the clock, with nothing to add.

    Each gradient weighs its push's samples: while every push of the clock carries as many
    (equal batches), the sum is the plain mean, as before; once batches differ (balanced
    batches, ``ps/balance.py``), it is the mean over all the clock's samples."""

    def __init__(self) -> None:
        self._sum: dict[int, torch.Tensor] | None = None
        self.open = False
        self.clock = -1
        self.count = 0
        self._lr_sum = 0.0
        self._weight0 = 0  # the first push's samples
        self._weights = 0  # all pushes' samples
        self._weighted = False  # the sum holds sum(samples * gradient): batches differed
        self.opened_at = 0.0  # monotonic time of the clock's first push
        self.arrived: list[float] = []  # monotonic times of its on-time pushes
        # each wave's earliest push in the open sum, by the clock it pushed (a late push folded
        # here and the wave's own push of this clock may both be in it)
        self.first_push: dict[WaveId, int] = {}

    def add(
        self,
        clock: int,
        grads: dict[int, torch.Tensor] | None,
        lr_scale: float,
        samples: int = 1,
        on_time: bool = True,
        pushed: tuple[WaveId, int] | None = None,  # the wave, and the clock it pushed for
    ) -> None:
        now = time.monotonic()
        if not self.open:
            self.open, self.clock, self.opened_at, self.arrived = True, clock, now, []
            self.first_push = {}
        if pushed is not None:
            self.first_push.setdefault(*pushed)
        if on_time:
            self.arrived.append(now)
        if grads is None:
            return
        samples = max(1, samples)
        if self._sum is None:
            self._sum, self._weight0 = {}, samples
        elif samples != self._weight0 and not self._weighted:
            for t in self._sum.values():  # from a plain sum to a sum over samples
                t.mul_(self._weight0)
            self._weighted = True
        for k, g in grads.items():
            g = g * samples if self._weighted else g
            if k in self._sum:
                self._sum[k].add_(g)
            else:  # the first gradient of k this clock; cloned: the gradients live in the
                # request's frames, released after the reply
                self._sum[k] = g.clone()
        self.count += 1
        self._weights += samples
        self._lr_sum += lr_scale

    def to_state(self, now: float) -> dict[str, Any]:
        """This open sum as plain values and tensors, for a planned hand-over (its times as
        ages: the standby's clock may be another host's)."""
        return {
            "clock": self.clock,
            "count": self.count,
            "lr_sum": self._lr_sum,
            "weight0": self._weight0,
            "weights": self._weights,
            "weighted": self._weighted,
            "age": now - self.opened_at,
            "arrived": [now - t for t in self.arrived],
            "first_push": [[w[0], w[1], c] for w, c in self.first_push.items()],
            "sum": self._sum,
        }

    @classmethod
    def from_state(
        cls, state: Any, now: float, shapes: dict[int, tuple[torch.Size, torch.dtype]]
    ) -> SyncSum:
        """``to_state``'s inverse; ``shapes``: each trainable chunk's (shape, dtype) a gradient
        of it must have. Raises TypeError or ValueError on anything else."""
        check_type(state, dict, "an open sum")
        s = cls()
        s.open = True
        s.clock, s.count = _typed(state, "clock", int), _typed(state, "count", int)
        s._weight0, s._weights = _typed(state, "weight0", int), _typed(state, "weights", int)
        s._lr_sum = _number(state["lr_sum"])
        s._weighted = _typed(state, "weighted", bool)
        s.opened_at = now - _number(state["age"])
        s.arrived = [now - _number(a) for a in _typed(state, "arrived", list)]
        for entry in _typed(state, "first_push", list):
            worker, index, clock = entry
            wave = (check_type(worker, str, "worker"), check_type(index, int, "wave"))
            s.first_push[wave] = check_type(clock, int, "clock")
        grads = state.get("sum")
        if grads is not None:
            for k, g in check_type(grads, dict, "sum").items():
                if k not in shapes or not isinstance(g, torch.Tensor):
                    raise ValueError(f"a sum for chunk {k!r}, which this shard does not train")
                if (g.shape, g.dtype) != shapes[k]:
                    raise ValueError(f"chunk {k}'s sum is {list(g.shape)} {g.dtype}")
            s._sum = grads
        if min(s.clock, s.count, s._weight0, s._weights) < 0:
            raise ValueError("a negative clock or count")
        return s

    def mean(self) -> tuple[dict[int, torch.Tensor], float, int] | None:
        """The mean gradient, the mean learning-rate factor and how many gradients were
        averaged (None: every wave skipped); closes the clock. A chunk some pushes had no
        gradient for counts as zero in theirs, and one none had stays out of the update, as
        DDP averages and leaves alone parameters unused on some or on every rank."""
        assert self.open
        out = None
        if self._sum is not None:
            total = self._weights if self._weighted else self.count
            grads = {k: s.div_(total) for k, s in self._sum.items()}
            out = grads, self._lr_sum / self.count, self.count
        self._sum, self.open, self.count, self._lr_sum = None, False, 0, 0.0
        self._weights, self._weighted = 0, False
        return out


class OpenSteps(NamedTuple):
    """A planned hand-over's open steps, read back (``SyncGroups.read_open``)."""

    sums: dict[Hashable, SyncSum]
    closed_clock: dict[Hashable, int]
    step_s: dict[Hashable, deque[float]]


class SyncGroups:
    """The open sums of every group; ``by_wave_index``: a group per local wave index (wave
    groups), else one group of all waves (bulk-synchronous); ``turn_delay``: how many of the
    other groups' updates a group's read may be behind (1: wave groups, 0: wave turns).

    ``quorum`` (k of n, one group of all waves): a step also closes once ``quorum(n)`` of its n
    live waves pushed it and the rest are late: not in within ``LATE_FACTOR`` of a recent
    step's time after the k-th (so that with every wave on time it is bulk-synchronous). A
    late push, for a step that closed without it, is folded into the open step (``late =
    "fold"``: counted in its mean, with its staleness) or dropped (``"drop"``)."""

    LATE_FACTOR = 0.25
    MIN_GRACE_S = 0.02
    TURNS_MEASURED = 4  # patience: a group's updates timed before any closes without a wave

    def __init__(
        self,
        by_wave_index: bool,
        turn_delay: int = 1,
        quorum: Callable[[int], int] | None = None,
        late: str = "fold",
        patience: float = 0.0,
    ):
        self.by_wave_index = by_wave_index
        self.turn_delay = turn_delay
        self.sums: dict[Hashable, SyncSum] = {}
        self.quorum = quorum
        self.late = late
        self.patience = patience
        self.closed_clock: dict[Hashable, int] = {}  # each group's newest step closed
        # k of n: how long recent steps took from their first push; patience: each group's
        # recent turns, from one of its updates to the next
        self.step_s: dict[Hashable, deque[float]] = {}
        self.closed_at: dict[Hashable, float] = {}
        self.late_pushes = 0
        self.dropped = 0
        self.closed_early = 0  # steps closed without a late wave (k of n, patience)

    def group_of(self, wave: WaveId) -> Hashable:
        return wave[1] if self.by_wave_index else "all"

    def _sum(self, wave: WaveId) -> SyncSum:
        return self.sums.setdefault(self.group_of(wave), SyncSum())

    def is_late(self, wave: WaveId, clock: int) -> bool:
        """k of n, patience: ``clock``'s step closed without this push."""
        if self.quorum is None and not self.patience:
            return False
        s = self._sum(wave)
        closed = self.closed_clock.get(self.group_of(wave), -1)
        return clock < s.clock if s.open else clock <= closed

    def check_push(self, wave: WaveId, clock: int) -> None:
        """A group's pushes come clock by clock: refuse one for another clock than the open
        (k of n takes a late one)."""
        s = self._sum(wave)
        if self.is_late(wave, clock):
            return
        if s.open and clock != s.clock:
            raise ProtocolError(
                ErrorCode.STALE_CLOCK,
                f"the synchronous clock {s.clock} of this wave's group is still open; "
                f"pull before pushing clock {clock}",
            )

    def add(
        self,
        wave: WaveId,
        clock: int,
        grads: dict[int, torch.Tensor] | None,
        lr: float,
        samples: int = 1,
    ) -> str:
        """Add a push to its group's sum; what became of it (accumulated, folded, dropped)."""
        s = self._sum(wave)
        if not self.is_late(wave, clock):
            s.add(clock, grads, lr, samples, pushed=(wave, clock))
            return "accumulated"
        self.late_pushes += 1
        if self.late == "drop":
            self.dropped += 1
            return "dropped"
        closed = self.closed_clock.get(self.group_of(wave), -1)
        s.add(s.clock if s.open else closed + 1, grads, lr, samples, False, (wave, clock))
        return "folded"

    def open_state(self) -> dict[str, Any]:
        """What a planned hand-over passes on besides the shard (``ps/replication.py``): each
        group's open sum and the steps already closed, so that the standby closes them as this
        shard would have and no push in them is lost (a late one folded in included)."""
        now = time.monotonic()
        return {
            "open": [[g, s.to_state(now)] for g, s in self.sums.items() if s.open],
            "closed": [[g, c] for g, c in self.closed_clock.items()],
            "step_s": [[g, list(t)] for g, t in self.step_s.items()],
        }

    @staticmethod
    def read_open(
        state: dict[str, Any], shapes: dict[int, tuple[torch.Size, torch.dtype]]
    ) -> OpenSteps:
        """``open_state``'s sums read back, checked whole (``shapes``: each trainable chunk's
        gradient shape and dtype); a malformed one is a ``malformed`` protocol error."""
        now = time.monotonic()
        try:
            return OpenSteps(
                {_group(g): SyncSum.from_state(s, now, shapes) for g, s in state["open"]},
                {_group(g): check_type(c, int, "clock") for g, c in state["closed"]},
                {_group(g): deque(map(_number, ts), maxlen=16) for g, ts in state["step_s"]},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(
                ErrorCode.MALFORMED, f"the open steps handed over are malformed: {e}"
            ) from None

    def take_open(self, steps: OpenSteps) -> None:
        """Go on with a planned hand-over's open steps (a standby taking the shard over)."""
        self.sums.update(steps.sums)
        self.closed_clock.update(steps.closed_clock)
        self.step_s.update(steps.step_s)

    def first_unapplied(self, wave: WaveId) -> int | None:
        """The clock of ``wave``'s earliest push still in its group's open sum (None: none)."""
        s = self.sums.get(self.group_of(wave))
        return s.first_push.get(wave) if s is not None and s.open else None

    def holds_back(self, wave: WaveId, clock: int) -> bool:
        """``wave`` may not read for ``clock`` yet: its group's update of an earlier clock is
        still being summed."""
        s = self._sum(wave)
        return s.open and clock > s.clock

    def in_turn(self, wave: WaveId, clock: int, clocks: ClockTable) -> bool:
        """Wave groups: the other groups are where the turn order needs them for ``wave`` to
        read ``clock`` (see the module's docstring)."""
        group = self.group_of(wave)
        for other in {self.group_of(w) for w in clocks.live} - {group}:
            # how many clocks they must have pushed (a step closed without a late wave counts
            # as pushed by it)
            need = (clock if other < group else clock - 1) + 1 - self.turn_delay
            done = self.closed_clock.get(other, -1) + 1 if self.patience else 0
            members = (w for w in clocks.live if self.group_of(w) == other)
            if any(max(clocks.clocks[w], done) < need for w in members):
                return False
        return True

    def _quorum_met(self, group: Hashable, s: SyncSum, live: int) -> bool:
        """k of n: k waves pushed the step and the others had their grace. Patience: at least
        half the group pushed, and the rest are later than ``patience`` of its usual turns."""
        recent = sorted(self.step_s.get(group, ()))
        if self.quorum is not None:
            k = min(max(1, self.quorum(live)), live)
            median = recent[len(recent) // 2] if recent else 0.0
            grace, since = max(self.MIN_GRACE_S, self.LATE_FACTOR * median), k - 1
        elif self.patience and len(recent) >= self.TURNS_MEASURED:
            k = (live + 1) // 2
            grace, since = max(self.MIN_GRACE_S, self.patience * recent[len(recent) // 2]), -1
        else:
            return False
        if len(s.arrived) < k:
            return False
        return time.monotonic() - s.arrived[since] >= grace

    def complete(self, clocks: ClockTable) -> list[tuple[dict[int, torch.Tensor], float, int]]:
        """Close every sum whose group's live waves have all pushed its clock; their means,
        in group order."""
        out = []
        for group in sorted(self.sums, key=str):
            s = self.sums[group]
            if not s.open:
                continue
            members = [clocks.clocks[w] for w in clocks.live if self.group_of(w) == group]
            waiting = bool(members) and min(members) <= s.clock
            if waiting and not self._quorum_met(group, s, len(members)):
                continue  # a live wave of the group has not pushed this clock yet
            self.closed_early += waiting
            now = time.monotonic()
            self.closed_clock[group] = s.clock
            turns = self.step_s.setdefault(group, deque(maxlen=16))
            if self.quorum is not None:
                turns.append(now - s.opened_at)
            elif group in self.closed_at:
                turns.append(now - self.closed_at[group])
            self.closed_at[group] = now
            mean = s.mean()
            if mean is not None:
                out.append(mean)
        return out


def _typed(state: Any, name: str, kind) -> Any:
    return check_type(state[name], kind, name)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return float(value)


def _group(group: Any) -> Hashable:
    """A group's key as a hand-over carries it: a wave index, or "all"."""
    if isinstance(group, bool) or not isinstance(group, int | str):
        raise TypeError(f"a group must be a wave index or a name, got {group!r}")
    return group
