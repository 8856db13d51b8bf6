"""All-reduce's checkpoints: what its users do to live through a membership change, since
torchrun restarts the whole group on one (the baseline Wavelet's elastic membership is compared
with, docs/faults.md).

Rank 0 saves the model, the optimizer and how far training got every ``checkpoint_every_s``;
a restarted group (``resume``) has rank 0 load them before DDP broadcasts its weights, and every
rank take rank 0's optimizer state, so the replicas stay equal.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from wavelet.common.records import save_whole

log = logging.getLogger(__name__)


def checkpoint_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints" / "allreduce.pt"


class RankCheckpoints:
    def __init__(self, run_dir: str | Path, every_s: float, rank: int):
        self.path = checkpoint_file(run_dir)
        self.every_s = every_s
        self.rank = rank
        self.last = time.monotonic()

    def restore_model(self, model: torch.nn.Module) -> dict:
        """Rank 0: the last checkpoint's weights into ``model`` (DDP then broadcasts them);
        returns its progress ({} where there is none). Other ranks: {} (they learn it below)."""
        if self.rank != 0 or not self.path.exists():
            return {}
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        self._optimizer = state["optimizer"]
        log.warning(
            "all-reduce resumes from its checkpoint: iteration %d, %.1f s trained",
            state["iteration"],
            state["elapsed_s"],
        )
        return {"iteration": state["iteration"], "elapsed_s": state["elapsed_s"]}

    def restore_optimizer(self, optimizer: torch.optim.Optimizer, progress: dict) -> dict:
        """Every rank: rank 0's optimizer state and progress (collective: all ranks call it)."""
        box = [(getattr(self, "_optimizer", None), progress)]
        dist.broadcast_object_list(box, src=0)
        state, progress = box[0]
        if state is not None:
            optimizer.load_state_dict(state)
        return progress

    def maybe_save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        iteration: int,
        elapsed: float,
    ) -> None:
        """Rank 0, when due: the model, the optimizer and the progress, whole or not at all."""
        if self.rank != 0 or not self.every_s or time.monotonic() - self.last < self.every_s:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "iteration": iteration,
            "elapsed_s": elapsed,
        }
        save_whole(state, self.path)
        self.last = time.monotonic()
