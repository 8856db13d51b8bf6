"""Pulling during forward: each layer's forward starts as soon as its own weights are in, while
the weights of later layers are still on the wire.

The shards answer a push in parts of about ``pull_part_kib`` each, in the order of the model's
tensors, which is the order most models run their layers (ps/datapath.py), and the wave loads
each part as it arrives (worker/client.py, ``PendingPull``). A forward pre-hook on every module
that holds a parameter or buffer of its own waits for that module's chunks only; the hook on the
model's end, and the end of the step, wait for all the rest, so a loss or a regularizer that
reads parameters after the model's forward sees the new weights too. The one thing it cannot
see is a parameter read inside a forward before its own module has run, by another module:
such a model must keep ``pull_during_forward`` off (the default).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from wavelet.common.sharding import Chunk
from wavelet.worker.rounds import PendingPull


class PullDuringForward:
    """Hooks on ``model``'s modules that wait for their chunks of a ``PendingPull``, while one
    is armed (``during``); ``tensors`` is name -> tensor as the chunks name them."""

    def __init__(
        self, model: torch.nn.Module, tensors: dict[str, torch.Tensor], chunks: list[list[Chunk]]
    ):
        keys_of: dict[int, set[int]] = {}  # id(tensor) -> its chunks' keys, on any shard
        for shard_chunks in chunks:
            for c in shard_chunks:
                keys_of.setdefault(id(tensors[c.name]), set()).add(c.key)
        self.pending: PendingPull | None = None
        self.handles = []
        for module in model.modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            keys = frozenset(k for t in own for k in keys_of.get(id(t), ()))
            if keys:
                self.handles.append(module.register_forward_pre_hook(self._waiting_for(keys)))
        # everything, once the model's forward is done: what runs after it sees the new weights
        self.handles.append(model.register_forward_hook(lambda *_: self._wait_all()))

    @contextmanager
    def during(self, pending: PendingPull | None) -> Iterator[None]:
        """The forward inside this block takes its weights from ``pending`` as they come; all
        of them are in once the block ends without an error."""
        if pending is None:
            yield
            return
        self.pending = pending
        try:
            yield
            pending.result()
        finally:
            self.pending = None

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _waiting_for(self, keys: frozenset[int]):
        def wait(_module, _inputs) -> None:
            pending = self.pending
            if pending is not None:  # armed: not an evaluation, not a backward's recompute
                pending.wait_for(keys)

        return wait

    def _wait_all(self) -> None:
        pending = self.pending
        if pending is not None:
            pending.result()
