"""Equal memory: for each mode of a comparison, the largest batch per task (wave or rank) whose
saved activations per device fit one budget.

A device's peak is measured, not assumed linear: probe forwards of the job's model at candidate
batches, with the saved-activation meter (on a GPU: the allocator's peak), times how many tasks'
activations a mode can hold at once on a device (tick-tock: 1 + baton_handoff, by the baton's
rule, or 1 where the worker computes its waves one at a time, worker/threads.py; two waves or
ranks started together: 2; one task: 1). The search doubles the batch until the budget is
passed, then bisects. The comparison then runs each mode at its batch, and its report gives the
peak each run really reached beside the budget.

Learning rate, by default, follows the batch linearly (Goyal et al., 2017): a mode whose updates
average k times the job's ``batch_size`` samples runs at k times its learning rate. An update
averages one task's batch on the PS; an all-reduce step averages the batches of all ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from wavelet.common.batches import cloned, to_device
from wavelet.common.config import JobConfig
from wavelet.common.job import build_dataset_and_model
from wavelet.common.models import checkpoint_blocks
from wavelet.common.settings import ConfigError
from wavelet.common.step import load_step
from wavelet.worker.memory import SavedActivationMeter

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}


class BudgetError(ConfigError):
    """Not even batch 1 fits the budget."""


@dataclass(frozen=True)
class Budget:
    """``bytes`` of saved activations per device, or ``relative`` x one wave's peak at the job's
    batch (``1.3x``)."""

    bytes: int = 0
    relative: float = 0.0

    def describe(self) -> str:
        return f"{self.relative:g}x one wave's peak" if self.relative else _size(self.bytes)


MAX_BYTES = 2**50  # 1 PiB: beyond any device's memory; larger is a typo (or 1e999 = inf)
MAX_RELATIVE = 1000.0


def parse_budget(text: str) -> Budget:
    """``200MB``, ``1.5GiB``, ``3e6`` (bytes) or ``1.3x`` (times one wave's peak)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not m:
        raise ConfigError(f"--memory-budget {text!r}: give a size like 200MB or 1.5GiB, or 1.3x")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "x":
        if not 0 < value <= MAX_RELATIVE:
            raise ConfigError(
                f"--memory-budget {text!r} is out of range: give a multiple above 0x and at "
                f"most {MAX_RELATIVE:g}x"
            )
        return Budget(relative=value)
    if unit not in _UNITS:
        raise ConfigError(
            f"--memory-budget {text!r}: unknown unit {unit!r}; use B, KB, MB, GB, "
            "KiB, MiB, GiB or x"
        )
    size = value * _UNITS[unit]
    if not 0 < size <= MAX_BYTES:
        raise ConfigError(
            f"--memory-budget {text!r} is out of range: give a size above 0 bytes and at most "
            f"{MAX_BYTES / 2**40:g} TiB"
        )
    size = int(size)
    return Budget(bytes=size)


def _size(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


class ActivationProbe:
    """Peak bytes one task of ``job`` keeps for backward, by batch, measured by running one
    forward (and on a GPU, backward) at that batch; each batch is measured once."""

    def __init__(self, job: JobConfig, checkpointing: bool, device: str = "cpu"):
        self.dataset, self.model = build_dataset_and_model(job, device)
        self.step = load_step(job.step, job.precision)
        if checkpointing:
            checkpoint_blocks(self.model)
        self.device = device
        self.checkpointing = checkpointing
        self._peaks: dict[int, int] = {}

    def peak(self, batch: int) -> int:
        if batch not in self._peaks:
            self._peaks[batch] = self._measure(batch)
        return self._peaks[batch]

    def _measure(self, batch: int) -> int:
        # real samples (the job's step may read the labels), repeated beyond the data, in
        # storage of their own (a slice would count the whole dataset)
        sample = cloned(to_device(self.dataset.sample_batch(batch), self.device))
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.step(self.model, sample)[0].backward()
            self.model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
        meter = SavedActivationMeter(self.model.parameters())
        with meter.hooks():
            loss, _ = self.step(self.model, sample)
        del loss
        return meter.peak


def largest_batch(
    probe: ActivationProbe, tasks_at_once: float, budget_bytes: int, limit: int
) -> tuple[int, int]:
    """The largest batch (at most ``limit``) whose device peak, ``tasks_at_once`` x one task's
    measured peak, fits ``budget_bytes``; and that peak. Raises BudgetError if batch 1 does not."""

    def peak(b: int) -> int:
        return int(tasks_at_once * probe.peak(b))

    if peak(1) > budget_bytes:
        raise BudgetError(
            f"even batch 1 needs {_size(peak(1))} of activations per device "
            f"({tasks_at_once:g} task(s) at once"
            f"{', checkpointed' if probe.checkpointing else ''}), more than the budget of "
            f"{_size(budget_bytes)}"
        )
    low, high = 1, 2
    while high <= limit and peak(high) <= budget_bytes:
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if peak(mid) <= budget_bytes else (low, mid)
    return low, peak(low)


def scaled_lr(job: JobConfig, samples_per_update: int, rule: str) -> float:
    """The learning rate for updates of ``samples_per_update`` samples (``linear`` or ``none``)."""
    if rule == "none":
        return job.optimizer.lr
    return job.optimizer.lr * samples_per_update / job.batch_size
