"""What a shard does with a stale gradient (staleness tau = updates applied since it was read).

- ``apply``: apply it as is.
- ``scale``: apply it with the learning rate divided by (1 + tau).
- ``drop``: reject it when tau exceeds a limit; the wave's push_pull still returns fresh weights,
  so the wave simply goes on from them.
- ``dc-asgd``: delay compensation (Zheng et al., 2017): g + lambda * g * g * (w_now - w_read).
  It needs the weights each wave read, so the shard keeps one copy of its chunks per wave,
  taken when it serves that wave's pull: memory = (live waves) x (this shard's parameter bytes).

Under a bulk-synchronous bound (s = 0) every gradient has tau = 0 and every policy is ``apply``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wavelet.common.config import STALE_POLICIES as POLICIES
from wavelet.ps.staleness import WaveId


@dataclass
class Decision:
    grads: dict[int, torch.Tensor] | None  # None: the gradient is dropped
    lr_scale: float = 1.0

    @property
    def action(self) -> str:
        return "dropped" if self.grads is None else "applied"


class StalenessPolicy:
    name = "apply"

    def on_read(self, wave: WaveId, params: dict[int, torch.Tensor]) -> None:
        """Called when ``wave`` is served the current weights."""

    def forget(self, wave: WaveId) -> None:
        """``wave`` left: drop anything kept for it."""

    def decide(
        self,
        wave: WaveId,
        tau: int,
        grads: dict[int, torch.Tensor],
        params: dict[int, torch.Tensor],
    ) -> Decision:
        return Decision(grads)


class ScalePolicy(StalenessPolicy):
    name = "scale"

    def decide(self, wave, tau, grads, params):
        return Decision(grads, 1.0 / (1.0 + tau))


class DropPolicy(StalenessPolicy):
    name = "drop"

    def __init__(self, limit: int):
        self.limit = limit

    def decide(self, wave, tau, grads, params):
        return Decision(None if tau > self.limit else grads)


class DcAsgdPolicy(StalenessPolicy):
    name = "dc-asgd"

    def __init__(self, lam: float):
        self.lam = lam
        self.read: dict[WaveId, dict[int, torch.Tensor]] = {}

    def on_read(self, wave, params):
        kept = self.read.get(wave)
        if kept is None:
            self.read[wave] = {k: p.detach().clone() for k, p in params.items()}
        else:  # reuse the copy's memory
            for k, p in params.items():
                kept[k].copy_(p.detach())

    def forget(self, wave):
        self.read.pop(wave, None)

    def decide(self, wave, tau, grads, params):
        kept = self.read.get(wave)
        if tau == 0 or kept is None:
            return Decision(grads)
        out = {}
        for k, g in grads.items():
            drift = params[k].detach() - kept[k]
            out[k] = g + self.lam * g * g * drift
        return Decision(out)


def make_policy(name: str, drop_limit: int, dc_lambda: float) -> StalenessPolicy:
    if name == "apply":
        return StalenessPolicy()
    if name == "scale":
        return ScalePolicy()
    if name == "drop":
        return DropPolicy(drop_limit)
    if name == "dc-asgd":
        return DcAsgdPolicy(dc_lambda)
    raise ValueError(f"unknown staleness policy {name!r}; choose one of {', '.join(POLICIES)}")
