"""The step of training: ``step(model, batch) -> loss``, the one piece every mode and probe runs.

Tick-tock waves, single and together waves, bulk-synchronous waves, all-reduce (with or without
activation checkpointing), the worker's thread probe and the memory-budget probe all compute their
loss with the job's step, as Lightning's ``training_step`` is the one place a model's loss is
written. Backward, pushes and all-reduce stay with the caller.

The job names its step (``step``): ``classification`` (the default: cross-entropy of the model's
output against the labels) or a user's own function by import path, ``package.module:function``,
called as ``function(model, batch)`` and returning the loss (a scalar tensor that requires grad)
or ``(loss, {"name": float, ...})`` to log more with every step record. What it returns is checked
every step; anything else stops the wave with one line naming the function and what it returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from wavelet.common.batches import describe, pair
from wavelet.common.imports import import_callable

log = logging.getLogger(__name__)

Logs = dict[str, float]


def classification_step(model: torch.nn.Module, batch) -> torch.Tensor:
    """Cross-entropy of ``model(x)`` against ``y`` for ``batch = (x, y)``."""
    out, y = logits_and_targets(model, batch, "step classification", StepError)
    if out.dim() < 2 or out.shape[1] < 2:
        # one output column: cross-entropy over one class is 0 whatever the model does
        raise StepError(
            f"step classification: the model's output has shape {tuple(out.shape)}, but "
            "cross-entropy needs (batch, classes, ...) with 2 or more classes; for another loss "
            "(a regression, say) pass --step package.module:function"
        )
    return F.cross_entropy(out, y)


def logits_and_targets(
    model: torch.nn.Module, batch: Any, what: str, error: type[ValueError]
) -> tuple[torch.Tensor, Any]:
    """``(model(x), y)`` of a batch ``(x, y)`` for the built-in step and accuracy (``what``),
    which need a pair and a model that returns a tensor of class logits: ``error`` naming what
    they got otherwise."""
    try:
        x, y = pair(batch, what)
    except ValueError as e:
        raise error(str(e)) from None
    out = model(x)
    if not isinstance(out, torch.Tensor):
        raise error(
            f"{what}: the model returned {describe(out)}, not a tensor of class logits; pass "
            "--step package.module:function (and --evaluate) to read outputs of that form"
        )
    return out, y


BUILTIN_STEPS: dict[str, Callable[..., Any]] = {"classification": classification_step}


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class StepError(ValueError):
    """The job's step returned something that is not a loss."""


class TrainingStep:
    """The job's step, checked: ``step(model, batch) -> (loss, logs)``; with ``precision`` bf16
    or fp16 it runs under ``torch.autocast`` on the model's device (the loss is returned as
    fp32; fp16's loss scaling is the caller's: worker/loss_scale.py, GradScaler)."""

    def __init__(self, name: str = "classification", precision: str = "fp32"):
        self.name = name
        self.precision = precision
        self._warned = False
        self.fn = BUILTIN_STEPS.get(name) or import_callable(name, "step", BUILTIN_STEPS)

    def __call__(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, Logs]:
        if self.precision == "fp32":
            return self.check(self.fn(model, batch))
        device = next(model.parameters()).device.type
        if device == "cpu" and self.precision == "fp16" and not self._warned:
            self._warned = True
            log.warning(
                "fp16 autocast on a CPU: convolutions have no fast fp16 kernel there (over 100x "
                "slower than fp32, benchmarks/bench_precision.py); use bf16 on CPUs"
            )
        with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPES[self.precision]):
            loss, logs = self.check(self.fn(model, batch))
        return loss.float(), logs

    def check(self, out: Any) -> tuple[torch.Tensor, Logs]:
        logs: Any = {}
        if isinstance(out, tuple) and len(out) == 2:
            out, logs = out
        where = f"step {self.name}"
        if not isinstance(out, torch.Tensor):
            raise StepError(
                f"{where} returned {type(out).__name__}, not a loss tensor: return the loss, or "
                "(loss, {name: float})"
            )
        if out.numel() != 1:
            raise StepError(
                f"{where} returned a tensor of shape {tuple(out.shape)}, not a scalar loss: "
                "reduce it (e.g. .mean())"
            )
        if not out.requires_grad:
            raise StepError(
                f"{where} returned a loss that does not require grad (computed under no_grad, "
                "or detached): compute it from the model's output"
            )
        if not isinstance(logs, dict):
            raise StepError(f"{where} returned {type(logs).__name__} as its logs, not a dict")
        try:
            logs = {str(k): float(v) for k, v in logs.items()}
        except (TypeError, ValueError) as e:
            raise StepError(f"{where} logged a value that is not a number: {e}") from None
        return out.reshape(()), logs


def clip_gradients(parameters, max_norm: float) -> float:
    """Scale the gradients of ``parameters`` down to L2 norm ``max_norm`` over all of them,
    as ``torch.nn.utils.clip_grad_norm_`` does; their norm before (a record's ``grad_norm``)."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    return float(norm)


def load_step(name: str, precision: str = "fp32") -> TrainingStep:
    """The job's step; ValueError naming the problem if it cannot be imported."""
    return TrainingStep(name, precision)
