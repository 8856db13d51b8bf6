"""The step of training: ``step(model, batch) -> loss``, the one piece every mode and probe runs.

Tick-tock waves, single and together waves, bulk-synchronous waves, all-reduce (with or without
activation checkpointing), the worker's thread probe and the memory-budget probe all compute their
loss with this function, as Lightning's ``training_step`` is the one place a model's loss is
written. Backward, pushes and all-reduce stay with the caller. The default is classification:
cross-entropy of the model's output against the labels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def classification_step(model: torch.nn.Module, batch) -> torch.Tensor:
    """Cross-entropy of ``model(x)`` against ``y`` for ``batch = (x, y)``."""
    x, y = batch
    return F.cross_entropy(model(x), y)


training_step = classification_step  # what every mode calls
