"""How a job is scored on its test set: top-1 accuracy by default, or the user's evaluation.

``--evaluate package.module:function`` names ``function(model, batches) -> {"metric": value}``,
called with the model in eval mode under ``torch.no_grad`` and an iterable of the test set's
batches already on the model's device. ``target_metric`` says which value is the headline (the
progress line, the summary, time to target in ``compare`` and ``tune``, TensorBoard) and
``target_mode`` whether higher (``max``) or lower (``min``, e.g. a perplexity) is better.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from wavelet.common.imports import import_callable
from wavelet.common.step import logits_and_targets

Metrics = dict[str, float]


def accuracy(model: torch.nn.Module, batches: Iterable) -> Metrics:
    """Top-1 accuracy of ``model(x)`` against class labels ``y``."""
    correct = seen = 0
    for batch in batches:
        out, y = logits_and_targets(model, batch, "evaluation accuracy", EvaluateError)
        correct += int((out.argmax(1) == y).sum())
        seen += len(y)
    return {"accuracy": correct / max(1, seen)}


BUILTIN_EVALUATIONS: dict[str, Callable[..., Any]] = {"accuracy": accuracy}


class EvaluateError(ValueError):
    """The job's evaluation returned no usable metrics."""


class Evaluation:
    """The job's evaluation, checked, and what its headline means."""

    def __init__(self, name: str = "accuracy", metric: str = "accuracy", mode: str = "max"):
        self.name, self.metric, self.mode = name, metric, mode
        self.fn = BUILTIN_EVALUATIONS.get(name) or import_callable(
            name, "evaluation", BUILTIN_EVALUATIONS
        )

    def __call__(self, model: torch.nn.Module, batches: Iterable) -> Metrics:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = self.fn(model, batches)
        finally:
            model.train(was_training)
        return self.check(out)

    def check(self, out: Any) -> Metrics:
        where = f"evaluation {self.name}"
        if not isinstance(out, dict):
            raise EvaluateError(
                f"{where} returned {type(out).__name__}, not a dict of metrics {{name: number}}"
            )
        try:
            metrics = {str(k): float(v) for k, v in out.items()}
        except (TypeError, ValueError) as e:
            raise EvaluateError(f"{where} returned a value that is not a number: {e}") from None
        if self.metric not in metrics:
            raise EvaluateError(
                f"{where} returned {sorted(metrics)} but not the target metric "
                f"{self.metric!r}: set target_metric to one of them"
            )
        return metrics

    def headline(self, metrics: Metrics) -> float:
        return metrics[self.metric]


def format_value(metric: str, value: float | None) -> str:
    """A headline value as reports show it: accuracy in percent, anything else as a number."""
    if value is None:
        return "n/a"
    return f"{100 * value:.2f}%" if metric == "accuracy" else f"{value:.4g}"


def format_target(metric: str, target: float) -> str:
    """``97%`` for accuracy, ``perplexity 20`` for another metric."""
    return f"{100 * target:g}%" if metric == "accuracy" else f"{metric} {target:g}"


def reached(value: float, target: float, mode: str) -> bool:
    return value >= target if mode == "max" else value <= target


def load_evaluation(job) -> Evaluation:
    """The job's evaluation; ValueError naming the problem if it cannot be imported."""
    return Evaluation(job.evaluate, job.target_metric, job.target_mode)
