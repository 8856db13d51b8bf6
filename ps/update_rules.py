"""How big a step one update takes: learning-rate and momentum rules that do not change with the
number of waves (docs/tuning.md, "Step size per update").

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

from wavelet.common.config import JobConfig, OptimizerConfig

log = logging.getLogger(__name__)


def update_lr_factor(rule: str, gradients: int, waves: int) -> float:
    """The lr factor of an update that averages ``gradients`` of the job's ``waves`` pushes."""
    if rule == "full" or waves <= 0:
        return 1.0
    return min(1.0, gradients / waves)


def update_streams(job: JobConfig, expect_waves: int) -> int:
    """How many streams of updates run asynchronously on a shard: every wave (async), the wave
    groups (one per local wave index) or one (bulk-synchronous)."""
    if job.staleness == 0:
        return 1
    if job.updates == "wave-groups":
        return job.waves
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
    if job.updates == "async" and job.staleness != 0 and expect_waves <= 0:
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
