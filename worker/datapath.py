"""A wave's data path: how its tensors reach each shard and how the shard's weights come back.

Per shard, one of two ways behind one interface: tensor frames over ZeroMQ, or the two
shared-memory segments the shard made for this wave (``ShmLink``) when both are on one host. On a
GPU, tensors go through pinned host memory with asynchronous copies; ``flush()`` waits for them
once per message. ``PSClient`` (worker/client.py) speaks the protocol and never touches a tensor's
bytes; the shard's mirror of this layer is ``ps/datapath.py``.
"""

from __future__ import annotations

import logging

import torch

from wavelet.common.sharding import Chunk, chunk_view
from wavelet.common.shm import Segment
from wavelet.worker.wave_memory import WaveMemory

log = logging.getLogger(__name__)

FP16_MAX = torch.finfo(torch.float16).max


class ShmLink:
    """A wave's side of its two segments on one shard, views of its chunks in each, and views
    of the trainable chunks in each of the shard's weight slots (``ps/weight_slots.py``)."""

    def __init__(self, push: Segment, pull: Segment, chunks: list[Chunk], offsets: list[int]):
        if len(offsets) != len(chunks):
            raise OSError(f"the shard laid out {len(offsets)} chunks, the plan has {len(chunks)}")
        self.push, self.pull = push, pull
        self.chunks = chunks
        wires = [c.wire_desc for c in chunks]
        self.push_views = push.tensors(offsets, wires)
        self.pull_views = pull.tensors(offsets, wires)
        self.slots: list[Segment] = []
        self.slot_views: list[list[torch.Tensor]] = []  # per slot, per trainable chunk
        self.in_wave_memory = False  # the shard writes our weights into our own memory

    @classmethod
    def open(cls, offer, chunks: list[Chunk]) -> ShmLink:
        """Open the segments of an ``AttachReply``; OSError when this process cannot."""
        push = Segment.open(offer.push_segment, offer.size, offer.nonce)
        opened = [push]
        try:
            pull = Segment.open(offer.pull_segment, offer.size, offer.nonce)
            opened.append(pull)
            link = cls(push, pull, chunks, offer.offsets)
            link.in_wave_memory = offer.wave_memory
            trainable = [c for c in chunks if c.trainable]
            if offer.weight_slots and len(offer.weight_offsets) != len(trainable):
                raise OSError(
                    f"the shard laid out {len(offer.weight_offsets)} trainable chunks in its "
                    f"weight slots, the plan has {len(trainable)}"
                )
            for name in offer.weight_slots:
                slot = Segment.open(name, offer.weight_size, offer.weight_nonce)
                opened.append(slot)
                link.slots.append(slot)
                link.slot_views.append(
                    slot.tensors(offer.weight_offsets, [c.desc for c in trainable])
                )
        except BaseException:
            for segment in opened:
                segment.close()
            raise
        if torch.cuda.is_available():
            for segment in opened:
                segment.pin()
        return link

    def pulled(self, slot: int) -> list[torch.Tensor]:
        """The weights a pull answered through shared memory: the trainable chunks from weight
        slot ``slot`` (-1: none, all from the pull segment), the rest from the pull segment."""
        if slot < 0:
            return self.pull_views
        if slot >= len(self.slot_views):
            raise ValueError(f"answered through weight slot {slot}, of {len(self.slot_views)}")
        in_slot = iter(self.slot_views[slot])
        return [
            next(in_slot) if c.trainable else v
            for c, v in zip(self.chunks, self.pull_views, strict=True)
        ]

    def close(self) -> None:
        self.push_views.clear()
        self.pull_views.clear()
        self.slot_views.clear()
        for segment in (self.push, self.pull, *self.slots):
            segment.close()
        self.slots.clear()


class WaveDataPath:
    """Moves one wave's tensors (``tensors``: name -> parameter or buffer) to and from shards;
    ``chunks[i]`` are the pieces shard ``i`` holds; ``error_feedback``: carry each gradient's
    16-bit rounding residual into the next."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        chunks: list[list[Chunk]],
        error_feedback: bool = False,
    ):
        self.tensors = tensors
        self.chunks = chunks
        self._wire_bytes = [sum(c.wire_nbytes for c in shard) for shard in chunks]  # per shard
        self.error_feedback = error_feedback
        self.links: list[ShmLink | None] = [None] * len(chunks)  # per shard, once attached
        self.memory: WaveMemory | None = None  # our parameters' memory, shared with shards
        self._memory_tried = False
        # (chunk key, dtype) -> pinned host copy (GPU): weights go up in fp32, gradients in wire
        self._staging: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._pending_device: torch.device | None = None
        self._residual: dict[int, torch.Tensor] = {}  # chunk key -> what rounding lost
        self.wire_overflows = 0  # fp16 gradients clamped to the largest finite value

    # --- how each shard is reached ------------------------------------------------------------

    def use_shm(self, shard: int, offer) -> None:
        """Reach ``shard`` through the segments it offered; OSError if they cannot be opened."""
        self.use_tcp(shard)
        self.links[shard] = ShmLink.open(offer, self.chunks[shard])

    def memory_offer(self, shard: int) -> dict:
        """What an attach request to ``shard`` says of our parameters' memory
        (``worker/wave_memory.py``): made at the first shared-memory attach where it fits;
        empty where there is none."""
        if not self._memory_tried:
            self._memory_tried = True
            if WaveMemory.fits(self.tensors, self.chunks):
                try:
                    self.memory = WaveMemory.create(self.tensors, self.chunks)
                except OSError as e:
                    log.info("pulled weights are copied into the model: %s", e)
        return self.memory.offer(self.chunks[shard]) if self.memory else {}

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
        return 2 * sum(n for i, n in enumerate(self._wire_bytes) if not self.shm(i))

    def close(self) -> None:
        for i in range(len(self.links)):
            self.use_tcp(i)
        if self.memory is not None:
            self.memory.close()
            self.memory, self._memory_tried = None, False

    # --- outgoing -----------------------------------------------------------------------------

    def weights(self, shard: int) -> list[torch.Tensor]:
        """Our current weights for ``shard``'s chunks, as frames (they seed an empty shard, so
        they go in full precision whatever the wire dtype)."""
        return [
            self._host(chunk_view(self.tensors[c.name].detach(), c), c) for c in self.chunks[shard]
        ]

    def gradients(self, shard: int) -> list[torch.Tensor]:
        """Our gradients (and buffer values) for ``shard``: frames to send, or, for a shard
        reached through shared memory, written into its push segment (no frames)."""
        link = self.links[shard]
        if link is None:
            return self.frames(self.chunks[shard])
        for c, view in zip(self.chunks[shard], link.push_views, strict=True):
            self._gradient_into(c, view)
        return []

    def frames(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Our gradients (and buffer values) for ``chunks`` of a shard reached over TCP."""
        return [self._push_tensor(c) for c in chunks]

    def without_gradient(self, shard: int) -> list[int]:
        """Keys of ``shard``'s trainable chunks whose parameter has no gradient this step (the
        loss did not use it): the push carries zeros for them and names them, so that the
        shard's optimizer leaves them alone as torch's does."""
        return [
            c.key for c in self.chunks[shard] if c.trainable and self.tensors[c.name].grad is None
        ]

    def flush(self) -> None:
        """Wait for the device-to-host copies of a message before ZeroMQ reads the buffers."""
        if self._pending_device is not None:
            torch.cuda.current_stream(self._pending_device).synchronize()
            self._pending_device = None

    # --- incoming -----------------------------------------------------------------------------

    def load(
        self,
        shard: int,
        shm: bool,
        keys: list[int],
        frames: list[torch.Tensor],
        start: int = 0,
        slot: int = -1,
        in_wave_memory: bool = False,
    ) -> list[int]:
        """Copy weights from ``shard`` into our tensors: the run of its chunks from ``start`` that
        ``keys`` names, from ``frames`` (a reply, or one part of it), or all of them through
        shared memory when the reply says so (``slot``: the weight slot its trainable chunks
        are in, ours to read until our next request; ``in_wave_memory``: the shard wrote them
        into our parameters already). Returns the keys loaded; ValueError when the reply names
        other chunks or a segment we lack."""
        written = False
        if shm:
            link = self.links[shard]
            if link is None:
                raise ValueError(
                    "answered through a shared-memory segment this wave has not attached"
                )
            if in_wave_memory and not link.in_wave_memory:
                raise ValueError("answered into a wave memory this wave did not offer")
            written = in_wave_memory
            frames = link.pulled(-1 if written else slot)
        chunks = self.chunks[shard][start : start + len(frames)]
        expected = [c.key for c in chunks]
        if list(keys) != expected or len(frames) != len(chunks):
            raise ValueError(
                f"sent {len(frames)} tensors for chunks {_brief(keys)} where chunks "
                f"{_brief(expected)} were due; run the same Wavelet release everywhere"
            )
        with torch.no_grad():
            for c, value in zip(chunks, frames, strict=True):
                if written and c.trainable:
                    continue  # the shard wrote it where our parameter lives
                target = chunk_view(self.tensors[c.name].data, c)
                if target.device.type == "cpu":
                    target.copy_(value)
                else:  # from a pinned segment: asynchronous; done before our next send
                    target.copy_(value, non_blocking=True)
                    self._pending_device = target.device
        return expected

    # --- one chunk ----------------------------------------------------------------------------

    def _gradient_into(self, chunk: Chunk, out: torch.Tensor) -> None:
        wire = chunk.wire_desc.torch_dtype
        if wire == torch.bfloat16 and not self.error_feedback:
            source = self._source(chunk)
            if source is not None and source.device.type == "cpu":
                out.copy_(source)  # the copy casts on its way: one pass, no 16-bit copy
                return
        value = self._outgoing(chunk)
        if value is None:  # a parameter this batch did not touch
            out.zero_()
            return
        out.copy_(value, non_blocking=value.device.type != "cpu")  # pinned segment: async D2H
        if value.device.type != "cpu":
            self._pending_device = value.device

    def _push_tensor(self, chunk: Chunk) -> torch.Tensor:
        value = self._outgoing(chunk)
        if value is None:  # a parameter this batch did not touch
            return torch.zeros(chunk.numel, dtype=chunk.wire_desc.torch_dtype)
        return self._host(value, chunk)

    def _outgoing(self, chunk: Chunk) -> torch.Tensor | None:
        """What a push carries for ``chunk``, in its wire dtype, where the tensor lives: the
        gradient of a parameter (None if it has none), the value of a buffer."""
        view = self._source(chunk)
        if view is None:
            return None
        wire = chunk.wire_desc.torch_dtype
        if view.dtype == wire:
            return view
        if chunk.trainable and self.error_feedback:
            residual = self._residual.get(chunk.key)
            if residual is not None:
                view = view + residual
        if wire == torch.float16:
            largest = float(view.abs().amax()) if view.numel() else 0.0
            # finite but beyond fp16: clamp and count; Inf or NaN go as they are, for the
            # shard to refuse as it refuses them in fp32
            if FP16_MAX < largest < float("inf"):
                self.wire_overflows += 1
                view = view.clamp(-FP16_MAX, FP16_MAX)
        sent = view.to(wire)
        if chunk.trainable and self.error_feedback:
            self._residual[chunk.key] = view - sent.to(view.dtype)
        return sent

    def _source(self, chunk: Chunk) -> torch.Tensor | None:
        """The chunk's gradient (None if it has none) or buffer value, as the model holds it."""
        t = self.tensors[chunk.name]
        if chunk.trainable:
            if t.grad is None:
                return None
            t = t.grad
        return chunk_view(t.detach(), chunk)

    def _host(self, tensor: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """``tensor`` on the host: itself on CPU, a pinned staging copy from a GPU."""
        if tensor.device.type == "cpu":
            return tensor
        slot = (chunk.key, tensor.dtype)
        staged = self._staging.get(slot)
        if staged is None or staged.shape != tensor.shape:
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._staging[slot] = staged
        staged.copy_(tensor, non_blocking=True)  # waited for once per message: flush()
        self._pending_device = tensor.device
        return staged


def _brief(keys: list[int]) -> str:
    return str(list(keys)) if len(keys) <= 4 else f"[{keys[0]}, {keys[1]}, ..., {keys[-1]}]"
