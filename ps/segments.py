"""The shared-memory segments a shard keeps for the waves on its host (see common/shm.py).

Each attached wave has two segments sized by this shard's chunks: the wave writes its gradients
into its push segment, and the shard writes the weights it serves that wave into its pull segment
(only its buffers where the wave reads the trainable weights from a weight slot,
``ps/weight_slots.py``).
One of each per wave, and a wave has at most one request in flight, so neither side ever reads a
segment the other is writing: a pulled weight set is exactly one version. Offsets come from the
shard's own chunk list, never from a client, so no request makes the shard read or write outside
them. Memory: 2 x (attached waves) x (this shard's parameter bytes, in the wire dtype).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from wavelet.common.settings import ConfigError
from wavelet.common.shm import (
    NoSpaceForSegments,
    Segment,
    SegmentsLock,
    layout,
    remove_segments,
)
from wavelet.ps.shard import ChunkSpec
from wavelet.ps.staleness import WaveId

log = logging.getLogger(__name__)


@dataclass
class WaveSegments:
    push: Segment
    pull: Segment
    offsets: list[int]
    push_views: list[torch.Tensor]  # one per chunk, in plan order
    pull_views: list[torch.Tensor]
    # the wave's own parameter memory (worker/wave_memory.py), where it offered one and this
    # shard could map it: a view per chunk, None for buffer chunks (they go by the pull segment)
    memory: Segment | None = None
    memory_views: list[torch.Tensor | None] | None = None

    def use_memory(self, memory: Segment, offsets: list[int], specs: list[ChunkSpec]) -> None:
        """Write pulled weights into ``memory``; OSError where the offsets do not fit it."""
        trainable = [s for s in specs if s.trainable]
        if len(offsets) != len(trainable):
            raise OSError(
                f"{len(offsets)} offsets for this shard's {len(trainable)} trainable chunks"
            )
        views = iter(memory.tensors(offsets, [s.desc for s in trainable]))
        self.memory_views = [next(views) if s.trainable else None for s in specs]
        self.memory = memory

    def close(self) -> None:
        self.push_views.clear()
        self.pull_views.clear()
        self.push.close()
        self.pull.close()
        if self.memory is not None:
            self.memory_views = None
            self.memory.close()
            self.memory = None


__all__ = ["NoSpaceForSegments", "SegmentStore", "ShardRunning", "WaveSegments"]


class ShardRunning(ConfigError):
    """Another live shard already serves this run dir and shard index (a setting to change, so
    the daemon exits with one line)."""


class SegmentStore:
    """Segments by wave, all named under ``prefix`` (one prefix per run and shard). With
    ``lock`` (a file in the run dir), the store first proves no live shard uses the prefix."""

    def __init__(self, prefix: str, lock: Path | None = None):
        self.prefix = prefix
        self.lock = SegmentsLock(lock) if lock else None
        if self.lock and not self.lock.acquire():
            raise ShardRunning(
                f"a shard of this run dir with this index is already running (pid "
                f"{self.lock.holder()}); stop it first, or use another --run-dir"
            )
        stale = remove_segments(prefix)  # what a killed predecessor of this shard left
        if stale:
            log.warning("removed %d shared-memory segment(s) a stopped shard left", len(stale))
        self.waves: dict[WaveId, WaveSegments] = {}

    def attach(self, wave: WaveId, specs: list[ChunkSpec]) -> WaveSegments:
        self.detach(wave)  # a wave that attaches again (a restart, a rejoin) gets new ones
        offsets, size = layout([s.wire.nbytes for s in specs])  # as they travel
        push = Segment.create(self.prefix, size)
        try:
            pull = Segment.create(self.prefix, size, push.nonce)  # one nonce for the pair
        except BaseException:
            push.close()
            raise

        wires = [s.wire for s in specs]
        segments = WaveSegments(
            push, pull, offsets, push.tensors(offsets, wires), pull.tensors(offsets, wires)
        )
        self.waves[wave] = segments
        return segments

    def get(self, wave: WaveId) -> WaveSegments | None:
        return self.waves.get(wave)

    def detach(self, wave: WaveId) -> None:
        segments = self.waves.pop(wave, None)
        if segments is not None:
            segments.close()

    def close(self) -> None:
        try:
            for wave in list(self.waves):
                self.detach(wave)
        finally:
            if self.lock:
                self.lock.release()
