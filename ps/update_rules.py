"""How a shard turns pushes into updates, and how big a step each update takes.

``Updates`` owns the choice: every push applied on arrival as the stale policy decides
(``ps/policy.py``) within the staleness bound, or the pushes of one clock averaged per group
(``ps/synchronous.py``: all waves under s = 0, or the tick and tock wave groups), and when a wave
may read. The step size follows rules that do not change with the number of waves
(docs/tuning.md, "Update rules"):

All-reduce takes one optimizer step with the job's lr per job-wide batch (every wave's samples).
A shard that applies every push of a wave's batch at that lr takes (number of waves) such steps
for the same samples; with ``update_lr = "by-samples"`` each update's lr is scaled by the share of
the job-wide batch it carries, the linear-scaling rule run backwards (Goyal et al. 2017).

N update streams that run asynchronously behave like SGD with an implicit momentum of about
1 - 1/N on top of the optimizer's (Mitliagkas et al. 2016); ``momentum_correction`` lowers the
optimizer's momentum mu to mu' so that 1 - mu = (1 - mu') / N, clamped at 0.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from wavelet.common.config import (
    BOUNDLESS_UPDATES,
    GROUPED_UPDATES,
    JobConfig,
    OptimizerConfig,
)
from wavelet.common.messages import PushRequest
from wavelet.ps.balance import BatchBalancer
from wavelet.ps.policy import make_policy
from wavelet.ps.shard import Shard
from wavelet.ps.staleness import ClockTable, StalenessBound, WaveId, WaveStats
from wavelet.ps.synchronous import SyncGroups

log = logging.getLogger(__name__)


def update_lr_factor(rule: str, gradients: int, waves: int) -> float:
    """The lr factor of an update that averages ``gradients`` of the job's ``waves`` pushes."""
    if rule == "full" or waves <= 0:
        return 1.0
    return min(1.0, gradients / waves)


def update_streams(job: JobConfig, expect_waves: int) -> int:
    """How many streams of updates run asynchronously on a shard: every wave (async), the wave
    groups (one per local wave index) or one (bulk-synchronous)."""
    if job.staleness == 0 or job.updates == "k-of-n":
        return 1
    if job.updates == "wave-groups":
        return job.waves
    if job.updates == "wave-turns":
        return 1  # one update at a time, each from the weights the last one left
    return max(expect_waves, 1)


def corrected_momentum(momentum: float, streams: int) -> float:
    return max(0.0, 1.0 - streams * (1.0 - momentum))


def shard_optimizer(job: JobConfig, expect_waves: int) -> OptimizerConfig:
    """The optimizer a shard runs: the job's, with momentum corrected when asked."""
    opt = job.optimizer
    momentum = opt.effective_kwargs.get("momentum")
    if not job.momentum_correction or not momentum:
        return opt
    streams = update_streams(job, expect_waves)
    if job.updates in ("async", "auto") and job.staleness != 0 and expect_waves <= 0:
        log.warning("momentum_correction needs the job's wave count (expect_waves): not applied")
        return opt
    mu = corrected_momentum(momentum, streams)
    log.info(
        "momentum %.3g over %d asynchronous update streams: the shard uses %.3g",
        momentum,
        streams,
        mu,
    )
    return dataclasses.replace(opt, kwargs={**opt.kwargs, "momentum": mu})


class Updates:
    """The update rule of one shard: applies what pushes carry to ``shard``."""

    def __init__(self, job: JobConfig, expect_waves: int, shard: Shard, clocks: ClockTable):
        self.shard, self.clocks = shard, clocks
        self.expect_waves = expect_waves
        self.update_lr = job.update_lr
        self.rule = job.updates
        self.bound = StalenessBound(job.staleness)
        self.policy = make_policy(job.stale_policy, job.drop_limit, job.dc_lambda)
        # one update per push (async), per clock of all waves (s = 0, k of n) or of each
        # wave group
        self.synchronous = job.staleness == 0 or job.updates in BOUNDLESS_UPDATES
        # a step's BatchNorm statistics: its own waves' (ps/shard.py)
        shard.statistics = "step" if self.synchronous else "sequential"
        quorum = None
        if job.updates == "k-of-n":
            self.bound = StalenessBound(math.inf)  # the quorum, not the slowest, sets the pace
            k = job.sync_quorum
            quorum = (lambda live: k) if k else (lambda live: (live + 1) // 2)
        self.sync = SyncGroups(
            by_wave_index=job.updates in GROUPED_UPDATES,
            turn_delay=0 if job.updates == "wave-turns" else 1,
            quorum=quorum,
            late=job.late_pushes,
            patience=job.turn_patience if job.updates in GROUPED_UPDATES else 0.0,
        )
        balance = job.balance_batches if self.synchronous else "off"
        self.balancer = BatchBalancer(
            balance, job.batch_size, self.sync.group_of, job.balance_max_factor
        )

    def describe(self) -> str:
        """The rule in a few words, as ``wavelet stats`` shows it."""
        if self.rule in GROUPED_UPDATES:
            rule = self.rule.replace("-", " ")  # their turn order is the bound
            if self.sync.patience:
                rule += f" ({self.sync.closed_early} without a late wave)"
        elif self.rule == "k-of-n":
            rule = f"k of n ({self.sync.late_pushes} late pushes, {self.sync.late} them)"
        elif self.bound.s == 0:
            rule = "bulk-synchronous (staleness bound 0)"
        else:
            rule = f"staleness bound {self.bound.s}"
        return rule

    def check_push(self, wave: WaveId, clock: int) -> None:
        """Refuse a push out of the synchronous order (before anything changes)."""
        if self.synchronous:
            self.sync.check_push(wave, clock)

    def push(
        self,
        wave: WaveId,
        clock: int,
        tau: int,
        tensors: list[torch.Tensor],
        push: PushRequest,
        stats: WaveStats,
    ) -> tuple[str, float]:
        """Apply a validated push now (asynchronous: as the policy decides) or add it to its
        group's open sum; returns what was done and the learning-rate factor used. Of ``push``:
        ``absent``, the chunks it has no gradient for, left out of the update; ``samples``, its
        batch; ``compute_s`` and ``overhead_s``, how long the wave computed a batch (of
        ``compute_samples``, 0: ``samples``; this one so far, where the push left during
        backward) and what else its step cost (balanced batches)."""
        grads = self.shard.gradients(tensors, push.absent)
        measured = push.compute_samples or push.samples
        self.balancer.record(wave, measured, push.compute_s, push.overhead_s)
        lr_scale = push.lr_scale
        if self.synchronous:
            self.shard.store_buffers(wave, tensors, push.samples, read=self.shard.version - tau)
            # The gradients of one clock of a group read the same version: average them (over
            # their samples, where batches differ).
            action = self.sync.add(wave, clock, grads, lr_scale, push.samples or 1)
            if action == "dropped":
                stats.dropped += 1
            return action, lr_scale
        decision = self.policy.decide(wave, tau, grads, self.shard.params)
        if decision.grads is None:
            # its statistics go with it: moved without a new version, a wave that then read
            # this version would count their change again when it pushed (sequential statistics)
            stats.dropped += 1
        else:
            # before the update, which serves the statistics it leaves with its new version
            self.shard.store_buffers(wave, tensors, push.samples, read=self.shard.version - tau)
            lr_scale *= decision.lr_scale * self._lr_factor(1)
            self.shard.apply(decision.grads, lr_scale)
        return decision.action, lr_scale

    def skip(self, wave: WaveId, clock: int, stats: WaveStats) -> str:
        """A step ``wave`` did not push (its fp16 gradients overflowed): its clock passes, so the
        staleness bound and synchronous sums go on without waiting for it; nothing changes."""
        stats.skipped += 1
        if self.synchronous:
            self.sync.add(wave, clock, None, 0.0)
        return "skipped"

    def complete(self) -> None:
        """Synchronous updates: apply each group's mean once every live wave of the group has
        pushed its open clock."""
        for grads, lr_scale, count in self.sync.complete(self.clocks):
            self.shard.apply(grads, lr_scale * self._lr_factor(count))

    def may_read(self, wave: WaveId, clock: int) -> bool:
        """Whether ``wave`` may read the weights for ``clock`` now (after the start barrier)."""
        if self.synchronous and self.sync.holds_back(wave, clock):
            return False
        if self.sync.by_wave_index:  # wave groups: the turn order is the bound
            return self.sync.in_turn(wave, clock, self.clocks)
        return self.bound.may_read(clock, self.clocks)

    def on_read(self, wave: WaveId) -> None:
        if not self.synchronous:
            self.policy.on_read(wave, self.shard.params)

    def forget(self, wave: WaveId) -> None:
        self.policy.forget(wave)
        self.balancer.forget(wave)

    def batch_for(self, wave: WaveId) -> int:
        """The batch ``wave`` should take next (balanced batches; 0: the job's)."""
        return self.balancer.batch_for(wave, self.clocks.live)

    def open_steps(self) -> dict:
        """The open synchronous steps as a planned hand-over passes them on (empty: none)."""
        return self.sync.open_state() if self.synchronous else {}

    def committed_clocks(self, clocks: dict[WaveId, int]) -> dict[WaveId, int]:
        """``clocks`` less the pushes still in an open synchronous sum (applied in no update
        yet): the clocks a copy of this shard's applied updates stands for. A wave whose late
        push was folded into the open sum is back at that push's clock, before its push of the
        open clock beside it."""
        out = dict(clocks)
        if self.synchronous:
            for wave in out:
                first = self.sync.first_unapplied(wave)
                if first is not None:
                    out[wave] = min(out[wave], first)
        return out

    def _lr_factor(self, gradients: int) -> float:
        """The job's update_lr rule for an update averaging ``gradients`` waves' pushes."""
        waves = self.expect_waves or len(self.clocks.live)
        return update_lr_factor(self.update_lr, gradients, waves)
