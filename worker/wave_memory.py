"""A wave's trainable parameters in memory the shards on its host write the pulled weights into.

Without it, a pull through shared memory ends with the wave copying every weight from the
shard's slot (``ps/weight_slots.py``) into its model: one pass over the model on the wave's
core per step. Here the model's parameters themselves live in one anonymous shared segment
(a memfd: nothing in /dev/shm to clean up, its memory goes with the last process that maps it);
each shard on the host maps it and copies the weights it serves straight into the wave's
parameters before it answers the pull, on the shard's own core, all shards at once. A shard
writes there only while the wave waits for that reply, and each writes only its own chunks, so
the wave never computes on weights being written.

Only where every trainable tensor is on the CPU and travels in its own dtype (a 16-bit wire
rounds the weights, a GPU copies them to the device anyway); otherwise, or where a shard cannot
map it (another host, another pid namespace), pulls go as before.
"""

from __future__ import annotations

import os

import torch

from wavelet.common.sharding import Chunk
from wavelet.common.shm import Segment, layout


class WaveMemory:
    """The segment and where each trainable tensor (by name) starts in it."""

    def __init__(self, segment: Segment, tensors: dict[str, torch.Tensor], offsets: dict[str, int]):
        self.segment = segment
        self.tensors = tensors  # the ones whose memory it is
        self.offsets = offsets

    @staticmethod
    def fits(tensors: dict[str, torch.Tensor], chunks: list[list[Chunk]]) -> bool:
        """Every trainable chunk travels in its own dtype, and its tensor is a dense CPU one."""
        trainable = [c for per_shard in chunks for c in per_shard if c.trainable]
        return bool(trainable) and all(
            c.wire == c.dtype
            and tensors[c.name].device.type == "cpu"
            and tensors[c.name].is_contiguous()
            for c in trainable
        )

    @classmethod
    def create(cls, tensors: dict[str, torch.Tensor], chunks: list[list[Chunk]]) -> WaveMemory:
        """Move the trainable tensors' values into a new segment and make it their memory;
        OSError where the system cannot make one."""
        names = list(dict.fromkeys(c.name for per in chunks for c in per if c.trainable))
        sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
        starts, size = layout(sizes)
        segment = Segment.anonymous(size)
        with torch.no_grad():
            for name, start in zip(names, starts, strict=True):
                t = tensors[name]
                view = segment.tensor(start, t.numel(), t.dtype).view(t.shape)
                view.copy_(t.data)
                t.data = view  # the parameter object stays; its storage is the segment
        return cls(segment, {n: tensors[n] for n in names}, dict(zip(names, starts, strict=True)))

    def offer(self, chunks: list[Chunk]) -> dict:
        """What an attach request tells one shard: how to map the segment, and the byte offset
        of each of its trainable chunks (in its order) there."""
        return {
            "memory_pid": os.getpid(),
            "memory_fd": self.segment.fd,
            "memory_size": self.segment.size,
            "memory_nonce": self.segment.nonce,
            "memory_offsets": [
                self.offsets[c.name] + c.offset * c.desc.torch_dtype.itemsize
                for c in chunks
                if c.trainable
            ],
        }

    def close(self) -> None:
        """The parameters back in private memory (the model outlives its client), then unmap:
        no shard may map it after this."""
        with torch.no_grad():
            for t in self.tensors.values():
                t.data = t.data.clone()
        self.tensors = {}
        self.segment.close()
