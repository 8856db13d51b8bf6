"""A batch as the job's step sees it: ``(inputs, targets)`` from the built-in datasets, or
whatever a user's ``collate_fn`` makes of a map-style dataset's samples (a dict of tensors, a
tuple of three, nested). Every mode moves a batch to its device as a whole and counts its
samples by the leading dimension of its first tensor; only the built-in step and evaluation
need it to be a pair (``pair``), and they say so where it is not."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it on ``device`` (the same structure: tensors, dicts,
    lists, tuples and named tuples, nested; anything else kept as it is)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    return _map(batch, lambda b: to_device(b, device, non_blocking))


def cloned(batch: Any) -> Any:
    """``batch`` with every tensor in storage of its own (a slice would count the whole
    dataset in a memory probe)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    return _map(batch, cloned)


def batch_samples(batch: Any) -> int:
    """Samples in ``batch``: the leading dimension of its first tensor."""
    first = _first_tensor(batch)
    if first is None or first.dim() == 0:
        raise ValueError(
            f"a batch of {describe(batch)} holds no tensor with a batch dimension: the "
            "collate_fn must return tensors (in a tuple, list or dict) whose first dimension "
            "counts the samples"
        )
    return int(first.shape[0])


def pair(batch: Any, what: str) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch that is a pair; ValueError naming ``what`` otherwise."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"{what} takes batches of (inputs, targets), and this one is {describe(batch)}: for "
        "batches of another form, pass your own --step (and --evaluate)"
    )


def describe(batch: Any) -> str:
    """A few words on a batch's form, for errors."""
    if isinstance(batch, Mapping):
        return f"a {type(batch).__name__} with keys {', '.join(map(str, batch))}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)}"
    return f"a {type(batch).__name__}"


def _map(batch: Any, fn) -> Any:
    if isinstance(batch, Mapping):
        items = {k: fn(v) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(fn(v) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(fn(v) for v in batch)
    return batch


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if not isinstance(batch, (tuple, list)):
        return None
    return next((t for t in map(_first_tensor, batch) if t is not None), None)
