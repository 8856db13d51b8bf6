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
then a wave of the group may not read (its next forward must see its group's update). Wave groups
also keep the turns in order (``in_turn``): group g reads clock c once every earlier group has
pushed c - 1 and every later group c - 2, which is the tick-tock timeline (tick c reads before
tock's update c - 1 lands, tock c after tick's update c - 1). Wave turns shift both by one
(``turn_delay`` 0): earlier groups must have pushed c, later ones c - 1.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from wavelet.common.protocol import ErrorCode, ProtocolError
from wavelet.ps.staleness import ClockTable, WaveId


class SyncSum:
    """The open clock of one group: the sum of its gradients and their count. A wave that
    skipped its step (fp16 overflow) counts as having pushed the clock, with nothing to add."""

    def __init__(self) -> None:
        self._sum: dict[int, torch.Tensor] | None = None
        self.open = False
        self.clock = -1
        self.count = 0
        self._lr_sum = 0.0

    def add(self, clock: int, grads: dict[int, torch.Tensor] | None, lr_scale: float) -> None:
        if not self.open:
            self.open, self.clock = True, clock
        if grads is None:
            return
        if self._sum is None:
            self._sum = {}
        for k, g in grads.items():
            if k in self._sum:
                self._sum[k].add_(g)
            else:  # the first gradient of k this clock; cloned: the gradients live in the
                # request's frames, released after the reply
                self._sum[k] = g.clone()
        self.count += 1
        self._lr_sum += lr_scale

    def mean(self) -> tuple[dict[int, torch.Tensor], float, int] | None:
        """The mean gradient, the mean learning-rate factor and how many gradients were
        averaged (None: every wave skipped); closes the clock. A chunk some pushes had no
        gradient for counts as zero in theirs, and one none had stays out of the update, as
        DDP averages and leaves alone parameters unused on some or on every rank."""
        assert self.open
        out = None
        if self._sum is not None:
            grads = {k: s.div_(self.count) for k, s in self._sum.items()}
            out = grads, self._lr_sum / self.count, self.count
        self._sum, self.open, self.count, self._lr_sum = None, False, 0, 0.0
        return out


class SyncGroups:
    """The open sums of every group; ``by_wave_index``: a group per local wave index (wave
    groups), else one group of all waves (bulk-synchronous); ``turn_delay``: how many of the
    other groups' updates a group's read may be behind (1: wave groups, 0: wave turns)."""

    def __init__(self, by_wave_index: bool, turn_delay: int = 1):
        self.by_wave_index = by_wave_index
        self.turn_delay = turn_delay
        self.sums: dict[Hashable, SyncSum] = {}

    def group_of(self, wave: WaveId) -> Hashable:
        return wave[1] if self.by_wave_index else "all"

    def _sum(self, wave: WaveId) -> SyncSum:
        return self.sums.setdefault(self.group_of(wave), SyncSum())

    def check_push(self, wave: WaveId, clock: int) -> None:
        """A group's pushes come clock by clock: refuse one for another clock than the open."""
        s = self._sum(wave)
        if s.open and clock != s.clock:
            raise ProtocolError(
                ErrorCode.STALE_CLOCK,
                f"the synchronous clock {s.clock} of this wave's group is still open; "
                f"pull before pushing clock {clock}",
            )

    def add(
        self, wave: WaveId, clock: int, grads: dict[int, torch.Tensor] | None, lr: float
    ) -> None:
        self._sum(wave).add(clock, grads, lr)

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
            # how many clocks they must have pushed
            need = (clock if other < group else clock - 1) + 1 - self.turn_delay
            if any(clocks.clocks[w] < need for w in clocks.live if self.group_of(w) == other):
                return False
        return True

    def complete(self, clocks: ClockTable) -> list[tuple[dict[int, torch.Tensor], float, int]]:
        """Close every sum whose group's live waves have all pushed its clock; their means,
        in group order."""
        out = []
        for group in sorted(self.sums, key=str):
            s = self.sums[group]
            if not s.open:
                continue
            members = [clocks.clocks[w] for w in clocks.live if self.group_of(w) == group]
            if members and min(members) <= s.clock:
                continue  # a live wave of the group has not pushed this clock yet
            mean = s.mean()
            if mean is not None:
                out.append(mean)
        return out
