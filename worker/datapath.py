"""A wave's data path: how its tensors reach each shard and how the shard's weights come back.

Per shard, one of two ways behind one interface: tensor frames over ZeroMQ, or the two
shared-memory segments the shard made for this wave (``ShmLink``) when both are on one host. On a
GPU, tensors go through pinned host memory with asynchronous copies; ``flush()`` waits for them
once per message. ``PSClient`` (worker/client.py) speaks the protocol and never touches a tensor's
bytes; the shard's mirror of this layer is ``ps/datapath.py``.
"""

from __future__ import annotations

import torch

from wavelet.common.sharding import Chunk, chunk_view
from wavelet.common.shm import Segment


class ShmLink:
    """A wave's side of its two segments on one shard: views of its chunks in each."""

    def __init__(self, push: Segment, pull: Segment, chunks: list[Chunk], offsets: list[int]):
        if len(offsets) != len(chunks):
            raise OSError(f"the shard laid out {len(offsets)} chunks, the plan has {len(chunks)}")
        for o, c in zip(offsets, chunks, strict=True):
            if o < 0 or o + c.nbytes > push.size:
                raise OSError(
                    f"chunk {c.key} at byte {o} does not fit the {push.size}-byte segment"
                )
        self.push, self.pull = push, pull
        self.push_views = [self._view(push, o, c) for o, c in zip(offsets, chunks, strict=True)]
        self.pull_views = [self._view(pull, o, c) for o, c in zip(offsets, chunks, strict=True)]

    @staticmethod
    def _view(segment: Segment, offset: int, chunk: Chunk) -> torch.Tensor:
        return segment.tensor(offset, chunk.numel, chunk.desc.torch_dtype)

    @classmethod
    def open(cls, offer, chunks: list[Chunk]) -> ShmLink:
        """Open the segments of an ``AttachReply``; OSError when this process cannot."""
        push = Segment.open(offer.push_segment, offer.size, offer.nonce)
        try:
            pull = Segment.open(offer.pull_segment, offer.size, offer.nonce)
        except BaseException:
            push.close()
            raise
        link = cls(push, pull, chunks, offer.offsets)
        if torch.cuda.is_available():
            push.pin()
            pull.pin()
        return link

    def close(self) -> None:
        self.push_views.clear()
        self.pull_views.clear()
        self.push.close()
        self.pull.close()


class WaveDataPath:
    """Moves one wave's tensors (``tensors``: name -> parameter or buffer) to and from shards;
    ``chunks[i]`` are the pieces shard ``i`` holds."""

    def __init__(self, tensors: dict[str, torch.Tensor], chunks: list[list[Chunk]]):
        self.tensors = tensors
        self.chunks = chunks
        self.links: list[ShmLink | None] = [None] * len(chunks)  # per shard, once attached
        self._staging: dict[int, torch.Tensor] = {}  # chunk key -> pinned host copy (GPU)
        self._pending_device: torch.device | None = None

    # --- how each shard is reached ------------------------------------------------------------

    def use_shm(self, shard: int, offer) -> None:
        """Reach ``shard`` through the segments it offered; OSError if they cannot be opened."""
        self.use_tcp(shard)
        self.links[shard] = ShmLink.open(offer, self.chunks[shard])

    def use_tcp(self, shard: int) -> None:
        if self.links[shard] is not None:
            self.links[shard].close()
            self.links[shard] = None

    def shm(self, shard: int) -> bool:
        return self.links[shard] is not None

    @property
    def transports(self) -> list[str]:
        return ["shm" if link else "tcp" for link in self.links]

    @property
    def round_trip_bytes(self) -> int:
        """Tensor bytes one push and pull put on the wire: every chunk up and back, except those
        of shards reached through shared memory."""
        return 2 * sum(
            c.nbytes for i, chunks in enumerate(self.chunks) if not self.shm(i) for c in chunks
        )

    def close(self) -> None:
        for i in range(len(self.links)):
            self.use_tcp(i)

    # --- outgoing -----------------------------------------------------------------------------

    def weights(self, shard: int) -> list[torch.Tensor]:
        """Our current weights for ``shard``'s chunks, as frames (they seed an empty shard)."""
        return [self._host(self.tensors[c.name], c) for c in self.chunks[shard]]

    def gradients(self, shard: int) -> list[torch.Tensor]:
        """Our gradients (and buffer values) for ``shard``: frames to send, or, for a shard
        reached through shared memory, written into its push segment (no frames)."""
        link = self.links[shard]
        if link is None:
            return [self._push_tensor(c) for c in self.chunks[shard]]
        for c, view in zip(self.chunks[shard], link.push_views, strict=True):
            self._gradient_into(c, view)
        return []

    def flush(self) -> None:
        """Wait for the device-to-host copies of a message before ZeroMQ reads the buffers."""
        if self._pending_device is not None:
            torch.cuda.current_stream(self._pending_device).synchronize()
            self._pending_device = None

    # --- incoming -----------------------------------------------------------------------------

    def load(self, shard: int, shm: bool, frames: list[torch.Tensor]) -> None:
        """Copy ``shard``'s weights into our tensors: from its frames, or from our pull segment
        when the reply says it wrote them there. ValueError when it names a segment we lack."""
        if shm:
            link = self.links[shard]
            if link is None:
                raise ValueError(
                    "answered through a shared-memory segment this wave has not attached"
                )
            frames = link.pull_views  # the weights this shard wrote for us alone
        with torch.no_grad():
            for c, value in zip(self.chunks[shard], frames, strict=True):
                target = chunk_view(self.tensors[c.name].data, c)
                if target.device.type == "cpu":
                    target.copy_(value)
                else:  # from a pinned segment: asynchronous; done before our next send
                    target.copy_(value, non_blocking=True)
                    self._pending_device = target.device

    # --- one chunk ----------------------------------------------------------------------------

    def _gradient_into(self, chunk: Chunk, out: torch.Tensor) -> None:
        t = self.tensors[chunk.name]
        if chunk.trainable:
            if t.grad is None:  # a parameter this batch did not touch
                out.zero_()
                return
            t = t.grad
        view = chunk_view(t.detach(), chunk)
        out.copy_(view, non_blocking=view.device.type != "cpu")  # pinned segment: async D2H
        if view.device.type != "cpu":
            self._pending_device = view.device

    def _push_tensor(self, chunk: Chunk) -> torch.Tensor:
        t = self.tensors[chunk.name]
        if chunk.trainable:
            if t.grad is None:  # a parameter this batch did not touch
                return torch.zeros(chunk.numel, dtype=t.dtype)
            t = t.grad
        return self._host(t, chunk)

    def _host(self, tensor: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """The chunk's slice on the host: a view on CPU, a pinned staging copy from a GPU."""
        view = chunk_view(tensor.detach(), chunk)
        if view.device.type == "cpu":
            return view
        staged = self._staging.get(chunk.key)
        if staged is None:
            staged = torch.empty(chunk.numel, dtype=view.dtype, pin_memory=True)
            self._staging[chunk.key] = staged
        staged.copy_(view, non_blocking=True)  # waited for once per message: flush()
        self._pending_device = view.device
        return staged
