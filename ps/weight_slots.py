"""Copy-free reads on one host: the shard's parameters live in shared memory its local waves map.

A shard keeps ``SLOTS`` segments, each the size of its trainable chunks in their own dtype, and
its parameters' memory is one of them. A pull through shared memory answers with the number of
the slot the parameters are in; the wave copies its weights straight from there into its model
(no copy by the shard into the wave's own segment) and the slot stays the wave's until its next
request to this shard, which says it is done reading. Before an update the shard makes sure no
wave holds the slot it writes: if one does (several waves read the same version), the parameters
first move to a free slot, one copy, which is what every pull cost before; with one reader
between updates they never move. No slot is written while a wave reads it, so no read is torn;
when every slot is held the parameters move to private memory and pulls go back to the copy
into the wave's segment (``ps/datapath.py``) until one is free.

Buffer chunks (BatchNorm statistics: a mean over the waves' uploads) still go through the
wave's own segment; they are small. Memory: ``SLOTS`` x (this shard's trainable bytes).
"""

from __future__ import annotations

import logging

import torch

from wavelet.common.shm import Segment, layout
from wavelet.ps.shard import ChunkSpec
from wavelet.ps.staleness import WaveId

log = logging.getLogger(__name__)

SLOTS = 3  # two waves reading two versions while the shard writes a third


class WeightSlots:
    """The shard's parameter memory, in ``count`` shared segments named under ``prefix``."""

    def __init__(self, prefix: str, specs: list[ChunkSpec], count: int = SLOTS):
        trainable = [s for s in specs if s.trainable]
        self.offsets, self.size = layout([s.desc.nbytes for s in trainable])
        self.segments: list[Segment] = []
        try:
            for _ in range(count):
                nonce = self.segments[0].nonce if self.segments else ""
                self.segments.append(Segment.create(prefix, self.size, nonce))
        except BaseException:
            self.close()
            raise
        descs = [s.desc for s in trainable]
        self.views = [seg.tensors(self.offsets, descs) for seg in self.segments]
        self.readers: dict[WaveId, int] = {}  # wave -> the slot its last pull pointed it at
        self.moves = 0  # times the parameters moved to another slot before an update

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.segments]

    @property
    def nonce(self) -> str:
        return self.segments[0].nonce

    def slot_of(self, params: list[torch.Tensor]) -> int | None:
        """The slot the parameters' memory is, or None (private memory)."""
        if not params:
            return None
        ptr = params[0].data_ptr()
        for i, views in enumerate(self.views):
            if views and views[0].data_ptr() == ptr:
                return i
        return None

    def pin(self, wave: WaveId, params: list[torch.Tensor]) -> int:
        """The slot a pull for ``wave`` reads, now the wave's until its next request; -1 where
        the parameters are in private memory (the wave gets a copy in its segment)."""
        self.release(wave)
        slot = self.slot_of(params)
        if slot is None:
            return -1
        self.readers[wave] = slot
        return slot

    def release(self, wave: WaveId) -> None:
        """``wave`` sent another request (or left): it is done with the slot it read."""
        self.readers.pop(wave, None)

    def make_writable(self, params: list[torch.Tensor]) -> bool:
        """Before an update: put the parameters where no wave reads, moving them to a free slot
        if a wave holds theirs. False when every slot is held: the caller moves them to private
        memory (``ps/shard.py``)."""
        held = set(self.readers.values())
        slot = self.slot_of(params)
        if slot is not None and slot not in held:
            return True  # written in place: the copy-free case
        free = [i for i in range(len(self.segments)) if i not in held and i != slot]
        if not free:
            return slot is None  # private memory nobody reads may be written in place
        self._move(params, free[0])
        self.moves += 1
        return True

    def place(self, params: list[torch.Tensor]) -> None:
        """The parameters into the first slot (the first shared-memory attach)."""
        if self.slot_of(params) is None:
            self._move(params, 0)

    def _move(self, params: list[torch.Tensor], slot: int) -> None:
        for p, view in zip(params, self.views[slot], strict=True):
            view.copy_(p.data)
            p.data = view

    def close(self) -> None:
        """Unlink the segments; the parameters' memory stays mapped while they view it."""
        for segment in self.segments:
            segment.close()
        self.segments = []
