"""SyncSum: the open bulk-synchronous clock (s = 0): the sum of its gradients and their count.

Every gradient of one clock was computed from the same version, so their mean is one update that
equals single-process training on the concatenated batches.
"""

from __future__ import annotations

import torch


class SyncSum:
    def __init__(self) -> None:
        self._sum: dict[int, torch.Tensor] | None = None
        self.clock = -1
        self.count = 0
        self._lr_sum = 0.0

    @property
    def open(self) -> bool:
        return self._sum is not None

    def add(self, clock: int, grads: dict[int, torch.Tensor], lr_scale: float) -> None:
        if self._sum is None:
            # cloned: the gradients live in the request's frames, released after the reply
            self._sum = {k: g.clone() for k, g in grads.items()}
            self.clock, self.count, self._lr_sum = clock, 1, lr_scale
            return
        for k, g in grads.items():
            self._sum[k].add_(g)
        self.count += 1
        self._lr_sum += lr_scale

    def mean(self) -> tuple[dict[int, torch.Tensor], float]:
        """The mean gradient and mean learning-rate factor; closes the clock."""
        assert self._sum is not None
        grads = {k: s.div_(self.count) for k, s in self._sum.items()}
        lr_scale = self._lr_sum / self.count
        self._sum, self.count, self._lr_sum = None, 0, 0.0
        return grads, lr_scale
