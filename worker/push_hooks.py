"""Pushing during backward: a shard's push goes out as soon as backward has made all of its
gradients, while backward goes on for the layers other shards hold.

Backward makes the last layers' gradients first, so with ``placement = "layers"`` (contiguous
runs of the model per shard, common/sharding.py) the last shard's push, its update and its reply
overlap the rest of backward, the way DDP all-reduces gradient buckets as they fill. With the
``size`` placement a shard usually holds some early layer too and its push waits for the end.
A parameter's gradient is final when its post-accumulate-grad hook runs (once per backward, also
for a parameter used twice). On a GPU autograd runs the hooks on its own device thread while the
wave's thread waits in ``backward()``, so a wave's sockets are still used by one thread at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from wavelet.common.sharding import Chunk


class PushDuringBackward:
    """Hooks on ``params`` (name -> parameter) that call ``send(shard)`` once every trainable
    chunk of ``chunks[shard]`` has its gradient, while armed (``arm``, once per backward)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], chunks: list[list[Chunk]]):
        self.shards_of: dict[str, list[int]] = {}
        self.needs: list[frozenset[str]] = []
        for shard, shard_chunks in enumerate(chunks):
            names = frozenset(c.name for c in shard_chunks if c.trainable)
            self.needs.append(names)
            for name in names:
                self.shards_of.setdefault(name, []).append(shard)
        self.pending: list[set[str]] = []
        self.send: Callable[[int], None] | None = None
        self.part: Callable[[int, str], None] | None = None
        self.handles = [
            p.register_post_accumulate_grad_hook(self._hook_for(name))
            for name, p in params.items()
            if name in self.shards_of
        ]

    def arm(
        self, send: Callable[[int], None], part: Callable[[int, str], None] | None = None
    ) -> None:
        """Call ``send`` for each shard as its gradients become ready in the next backward,
        and ``part(shard, name)`` as each of its parameters' is."""
        self.pending = [set(names) for names in self.needs]
        self.send = send
        self.part = part

    def disarm(self) -> None:
        self.send = self.part = None

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _hook_for(self, name: str) -> Callable[[torch.Tensor], None]:
        def ready(_param: torch.Tensor) -> None:
            send = self.send
            if send is None:  # not armed: a backward of the user's own, an evaluation
                return
            part = self.part
            for shard in self.shards_of[name]:
                waiting = self.pending[shard]
                waiting.discard(name)
                if not waiting:
                    send(shard)
                elif part is not None:
                    part(shard, name)

        return ready
