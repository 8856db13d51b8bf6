"""How many torch threads a CPU worker process uses, chosen by a short probe at start-up.

Two layouts (measured with ``wavelet compare``, modes ticktock and ticktock-wide; docs/design.md):
- narrow: the process's cores split among its waves (one thread per wave on 2 cores), so the
  parts of the waves' steps that overlap run side by side. Best where operations are too small to
  split across threads: on the digits CNN the wide layout trained at 0.73x.
- wide: every core for every operation, so the wave holding the baton computes on all of them.
  Best where operations are large: ResNet-18 trained 1.5x faster.
The rule, from a probe of the job's own model and batch: go wide when one step alone is at least
``WIDE_GAIN`` times faster on all the cores and takes at least ``WIDE_MIN_STEP_S`` on the narrow
setting. Timing two waves side by side would mislead: it leaves out the baton, which is what
keeps a big model's waves mostly one at a time (ResNet-18: 0.61 s narrow, 0.63 s wide side by
side, 0.61 s against 0.30 s alone); and a step alone favours wide for small models (digits: 2.5 ms
narrow, 1.6 ms wide alone) whose real steps overlap. Under wave turns no two waves' steps
overlap, so there the step's length does not matter, only whether it runs faster wide. The probe
still decides under turns: on a machine busy with another job, all cores for one process means
more threads than cores, and two default jobs side by side that went wide without a probe
trained 33x slower (99 samples/s each against 3255 narrow). ``--threads`` overrides the probe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from wavelet.common.config import JobConfig
from wavelet.common.models import build_model
from wavelet.common.step import TrainingStep, load_step

log = logging.getLogger(__name__)

WIDE_GAIN = 1.3  # a step alone must be this much faster on all cores...
WIDE_MIN_STEP_S = 0.05  # ...and this long narrow: shorter steps are per-operation overhead
# Timed rounds of the probe (one step at each setting), after a warm-up: at least the first
# number, and more up to the second while the probe has taken under PROBE_BUDGET_S. On this
# noisy machine the narrow ResNet (wide 1.45-1.6x faster at the median) went narrow in 9 of 45
# probes on the best of two steps and in 6 of the same 45 on the best of four: a moment's load on
# the wide steps is enough (benchmarks/bench_compute.py --probe 15, three runs).
PROBE_ROUNDS = (2, 4)
PROBE_BUDGET_S = 1.5


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    layout: str  # narrow | wide | fixed
    narrow_s: float = 0.0  # one probe step's time at each setting (0: not probed)
    wide_s: float = 0.0
    reason: str = ""  # why, where no probe decided

    def describe(self) -> str:
        if self.layout == "fixed":
            return f"{self.threads} torch thread(s), as asked (--threads)"
        why = [self.reason] if self.reason else []
        if self.narrow_s:
            why.append(
                f"probe: one step took {1000 * self.narrow_s:.1f} ms narrow, "
                f"{1000 * self.wide_s:.1f} ms wide"
            )
        return f"{self.threads} torch thread(s), {self.layout} layout" + (
            f" ({'; '.join(why)})" if why else ""
        )


def probe_threads(
    job: JobConfig, device: str, budget: int, dataset, fixed: int = 0
) -> ThreadChoice:
    """The layout a worker of ``job`` on ``device`` with ``budget`` cores runs: ``fixed``
    threads where the user gave them (``--threads``); else on a CPU, from a probe of the job's
    model on one batch of ``dataset``; a GPU computes, so its waves split the cores."""
    if fixed:
        return ThreadChoice(fixed, "fixed")
    if torch.device(device).type != "cpu":
        return ThreadChoice(max(1, budget // job.waves), "narrow")
    model = build_model(
        job.model, dataset.input_shape, dataset.num_classes, job.seed, **job.model_kwargs
    )
    part = dataset.part(0, 1, job.seed)
    batch = dataset.sample_batch(min(job.batch_size, len(part)))
    step = load_step(job.step, job.precision)
    # under strict turns no two waves' steps overlap: any step that runs faster wide goes wide
    overlap = job.updates != "wave-turns"
    return choose_threads(model, batch, budget, job.waves, step, overlap)


def computes_one_at_a_time(device: str, choice: ThreadChoice) -> bool:
    """Whether the waves' forwards and backwards run one at a time on the worker's own thread
    (worker/compute.py): on a CPU where they get several cores. Their saved activations then
    never overlap: one wave's backward ends before the next forward starts."""
    return torch.device(device).type == "cpu" and choice.threads > 1


def choose_threads(
    model: torch.nn.Module,
    batch,
    budget: int,
    waves: int,
    step: TrainingStep,
    overlap: bool = True,
) -> ThreadChoice:
    """Probe ``model`` on one batch and pick the layout for ``waves`` waves on ``budget`` cores;
    ``overlap``: whether the waves' steps may run side by side (not under wave turns)."""
    narrow = max(1, budget // max(1, waves))
    if narrow == budget:
        return ThreadChoice(budget, "narrow")
    narrow_s, wide_s = _step_times(model, batch, (narrow, budget), step)
    model.zero_grad(set_to_none=True)
    wide = goes_wide(narrow_s, wide_s, overlap)
    layout = "wide" if wide else "narrow"
    reason = "" if overlap else "wave turns: no two waves' steps overlap"
    return ThreadChoice(budget if wide else narrow, layout, narrow_s, wide_s, reason)


def goes_wide(narrow_s: float, wide_s: float, overlap: bool = True) -> bool:
    """The probe's rule: wide where a step alone runs ``WIDE_GAIN`` times faster on all cores,
    and, where waves' steps overlap, takes ``WIDE_MIN_STEP_S`` narrow. A busy machine makes wide
    slower, not faster (its threads wait for each other's cores), so the rule keeps a worker
    narrow there."""
    faster = narrow_s >= WIDE_GAIN * wide_s
    return faster and (narrow_s >= WIDE_MIN_STEP_S or not overlap)


def _step_times(
    model: torch.nn.Module, batch, settings: tuple[int, ...], step: TrainingStep
) -> list[float]:
    """The best step (after a warm-up) at each thread count over ``PROBE_ROUNDS``, taken in
    turns, so that a moment's load elsewhere falls on every setting alike."""
    return [min(times) for times in timed_rounds(model, batch, settings, step)]


def timed_rounds(
    model: torch.nn.Module,
    batch,
    settings: tuple[int, ...],
    step: TrainingStep,
    rounds: tuple[int, int] = PROBE_ROUNDS,
) -> list[list[float]]:
    """Per thread count in ``settings``, the time of one step in each timed round: a warm-up
    round, then ``rounds[0]`` rounds, and more up to ``rounds[1]`` while under
    ``PROBE_BUDGET_S``; each round one step at every setting in turn."""
    times: list[list[float]] = [[] for _ in settings]
    began = time.perf_counter()
    fewest, most = rounds
    for i in range(most + 1):  # the first round is a warm-up
        if i > fewest and time.perf_counter() - began >= PROBE_BUDGET_S:
            break
        for k, threads in enumerate(settings):
            torch.set_num_threads(threads)
            start = time.perf_counter()
            step(model, batch)[0].backward()
            if i:
                times[k].append(time.perf_counter() - start)
    return times
