"""Dynamic loss scaling for fp16 compute, one scale per wave.

fp16 gradients underflow without a scale and overflow with too big a one. torch's ``GradScaler``
finds the scale with its optimizer step; a wave has no optimizer (the shards do), so this is the
same policy without one: scale the loss, unscale the gradients in place, and on Inf or NaN skip
the step (the wave tells the shards, ``PSClient.push_pull(skip=True)``) and halve the scale; after
``growth_interval`` good steps in a row, double it. All-reduce mode uses ``GradScaler`` itself.
"""

from __future__ import annotations

import torch


class LossScale:
    """With ``enabled`` False (fp32 and bf16 compute) every method is a no-op that reports
    finite gradients."""

    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        backoff: float = 0.5,
        growth: float = 2.0,
    ):
        self.enabled = enabled
        self.value = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.backoff, self.growth = backoff, growth
        self.good_steps = 0
        self.skipped = 0  # steps whose gradients were not finite

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value if self.enabled else loss

    def unscale(self, model: torch.nn.Module) -> bool:
        """Divide ``model``'s gradients by the scale; whether they are all finite."""
        if not self.enabled:
            return True
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return True
        torch._foreach_mul_(grads, 1.0 / self.value)
        # a sum is Inf or NaN when any element is (finite sums beyond fp32's range aside)
        return bool(torch.isfinite(torch.stack([g.sum() for g in grads]).sum()))

    def update(self, finite: bool) -> None:
        """After a step: back off on overflow, grow after a run of good steps."""
        if not self.enabled:
            return
        if not finite:
            self.skipped += 1
            self.good_steps = 0
            self.value = max(self.value * self.backoff, 1.0)
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.good_steps = 0
            self.value *= self.growth
