"""The shard's data path: where a wave's gradients come from and where its weights go.

Two ways, behind one small interface: tensor frames over ZeroMQ, or the wave's shared-memory
segments (``ps/segments.py``) when it is on the shard's host, where the wave reads the trainable
weights straight from the shard's own memory (``ps/weight_slots.py``). The rules
(``ps/service.py``) see plain tensors and hand back plain tensors; only this layer knows which
way they travel, as ps-lite's ``Van`` sits below its request handler.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wavelet.common.daemon_config import PSConfig
from wavelet.common.messages import AttachReply, AttachRequest
from wavelet.common.protocol import ErrorCode, Header, ProtocolError, wave_name
from wavelet.common.shm import Segment, run_prefix
from wavelet.ps.segments import NoSpaceForSegments, SegmentStore, WaveSegments
from wavelet.ps.shard import Shard
from wavelet.ps.staleness import WaveId
from wavelet.ps.weight_slots import WeightSlots

log = logging.getLogger(__name__)


@dataclass
class Outgoing:
    """One message for the transport to send to ``peer`` (a ROUTER identity)."""

    peer: bytes
    header: Header
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def carries_weights(self) -> bool:
        """Its tensors are the shard's parameter memory (sent zero-copy)."""
        return bool(self.tensors)


class ShardDataPath:
    """Frames or segments, per wave. Memory: 2 x (attached waves) x (the shard's bytes), and
    the weight slots' 3 x (its trainable bytes) once a wave attaches through shared memory."""

    def __init__(self, config: PSConfig, pid: int):
        self.segments: SegmentStore | None = None
        self.slots: WeightSlots | None = None
        self.shard: Shard | None = None
        # shared-memory pulls, by how they were served
        self.reads = {"into_wave": 0, "in_place": 0, "copied": 0}
        if config.shm:
            # per run dir, so that a restarted shard or the launcher finds what a killed one left
            base = run_prefix(config.run_dir) if config.run_dir else f"wavelet-{pid}-"
            # a standby hosted beside a primary of the same index and run dir (one host, shard
            # replicas) keeps its own names and lock: neither removes the other's segments
            name = f"{config.shard_index}-standby" if config.standby_role else config.shard_index
            lock = Path(config.run_dir) / f"ps-{name}.lock" if config.run_dir else None
            tag = "b" if config.standby_role else ""
            self.segments = SegmentStore(f"{base}s{config.shard_index}{tag}-", lock)

    def gradients(self, wave: WaveId, shm: bool, frames: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors a push carries: its frames, or (``shm``) the wave's push segment, to be
        validated by the caller either way."""
        if not shm:
            return frames
        if frames:
            raise ProtocolError(
                ErrorCode.MALFORMED, "a shared-memory push carries no tensor frames"
            )
        return self._segments_of(wave).push_views

    def check_pull(self, wave: WaveId, shm: bool) -> None:
        """Refuse now a pull to be answered through segments the wave does not have."""
        if shm:
            self._segments_of(wave)

    def weights_reply(
        self,
        peer: bytes,
        header: Header,
        values: list[torch.Tensor],
        wave: WaveId | None,
        shm: bool,
        part_bytes: int = 0,
    ) -> list[Outgoing]:
        """``values`` for ``wave``: zero-copy frames, or through shared memory: the trainable
        chunks read in place from a weight slot (``header.body.slot``), the rest copied into
        the wave's pull segment (it reads it before its next request, so nothing else writes
        it meanwhile). Frames asked for in parts (``part_bytes``) go as one message per run of
        chunks of about that many bytes, in the shard's order, so the wave can start on the
        first layers' weights while the rest are on the wire (worker/pull_hooks.py)."""
        if shm and wave is not None:
            segments = self._segments_of(wave)
            if segments.memory_views is not None:  # into the wave's own parameters
                self.reads["into_wave"] += 1
                for view, mine, value in zip(
                    segments.pull_views, segments.memory_views, values, strict=True
                ):
                    (view if mine is None else mine).copy_(value)
                body = {**header.body, "in_wave_memory": True}
                return [Outgoing(peer, dataclasses.replace(header, body=body))]
            slot = self._pin(wave)
            self.reads["copied" if slot < 0 else "in_place"] += 1
            specs = self.shard.specs if self.shard is not None else []
            for i, (view, value) in enumerate(zip(segments.pull_views, values, strict=True)):
                if slot < 0 or not specs[i].trainable:
                    view.copy_(value)
            return [Outgoing(peer, dataclasses.replace(header, body={**header.body, "slot": slot}))]
        runs = _runs(values, part_bytes)
        if len(runs) == 1:
            return [Outgoing(peer, header, values)]
        return [
            Outgoing(
                peer,
                dataclasses.replace(
                    header,
                    keys=header.keys[start:stop],
                    body={**header.body, "part": part, "parts": len(runs)},
                ),
                values[start:stop],
            )
            for part, (start, stop) in enumerate(runs)
        ]

    def attach(self, wave: WaveId, request: AttachRequest, shard: Shard) -> AttachReply:
        """How ``wave`` exchanges tensors from now on: new segments when it asks for shared
        memory and the shard can make them, else TCP and why; and whether pulled weights go
        straight into the wave's own memory, where it offers it."""
        self.detach(wave)
        version = shard.version
        if request.transport == "tcp":
            return AttachReply(version, "tcp")
        if self.segments is None:
            return AttachReply(version, "tcp", reason="the shard was started with --no-shm")
        try:
            segments = self.segments.attach(wave, shard.specs)
        except NoSpaceForSegments as e:
            log.warning("wave %s uses TCP: %s", wave_name(*wave), e)
            return AttachReply(version, "tcp", reason=str(e))
        slots = self._slots_for(shard)
        refused = _use_wave_memory(segments, request, shard.specs) if request.memory_pid else ""
        if refused:
            log.info("weights for wave %s are copied: %s", wave_name(*wave), refused)
        return AttachReply(
            version=version,
            wave_memory=segments.memory is not None,
            memory_reason=refused,
            transport="shm",
            push_segment=segments.push.name,
            pull_segment=segments.pull.name,
            nonce=segments.push.nonce,
            size=segments.push.size,
            offsets=segments.offsets,
            weight_slots=slots.names if slots else [],
            weight_nonce=slots.nonce if slots else "",
            weight_size=slots.size if slots else 0,
            weight_offsets=slots.offsets if slots else [],
        )

    def read_counts(self) -> dict[str, int]:
        return {**self.reads, "slot_moves": self.slots.moves if self.slots else 0}

    def done_reading(self, wave: WaveId) -> None:
        """A new request from ``wave``: the weight slot it last read is free again."""
        if self.slots is not None:
            self.slots.release(wave)

    def detach(self, wave: WaveId) -> None:
        self.done_reading(wave)
        if self.segments:
            self.segments.detach(wave)

    def close(self) -> None:
        if self.shard is not None:
            self.shard.memory = None
        if self.slots is not None:
            self.slots.close()
            self.slots = None
        if self.segments:
            self.segments.close()

    def _slots_for(self, shard: Shard) -> WeightSlots | None:
        """The shard's weight slots, made at the first shared-memory attach (None: the shard
        has no trainable chunks, or no room for them; its waves get copies). Not on a 16-bit
        wire: every wave computes on the rounded weights, as over TCP, and rounding is a copy
        anyway (into the wave's segment, one pass)."""
        native = _native(shard.specs)
        if self.slots is None and self.segments is not None and shard.params and native:
            try:
                self.slots = WeightSlots(self.segments.prefix + "w-", shard.specs)
            except NoSpaceForSegments as e:
                log.warning("local waves read copies of the weights: %s", e)
                return None
            self.shard = shard
            shard.memory = self.slots
            self.slots.place(list(shard.params.values()))
        return self.slots

    def _pin(self, wave: WaveId) -> int:
        if self.slots is None or self.shard is None:
            return -1
        return self.slots.pin(wave, list(self.shard.params.values()))

    def _segments_of(self, wave: WaveId) -> WaveSegments:
        segments = self.segments.get(wave) if self.segments else None
        if segments is None:
            raise ProtocolError(
                ErrorCode.NOT_ATTACHED,
                f"wave {wave_name(*wave)} has no shared-memory segments on this shard; "
                "attach first (or send tensor frames)",
            )
        return segments


def _native(specs) -> bool:
    """Every trainable chunk travels in the dtype the shard keeps it in (no 16-bit wire)."""
    return all(s.wire == s.desc for s in specs if s.trainable)


def _use_wave_memory(segments: WaveSegments, request: AttachRequest, specs) -> str:
    """Map the memory a wave offered for its weights (``worker/wave_memory.py``); why not, or
    "" once it is in use. A bad offer costs the wave only the copy: it is never an error."""
    if not _native(specs):
        return "its weights travel in another dtype than the shard keeps them"
    try:
        memory = Segment.proc_open(
            request.memory_pid, request.memory_fd, request.memory_size, request.memory_nonce
        )
    except OSError as e:
        return f"cannot map the wave's memory ({e})"
    try:
        segments.use_memory(memory, request.memory_offsets, specs)
    except OSError as e:
        memory.close()
        return f"the wave's memory does not fit its offsets ({e})"
    return ""


def _runs(values: list[torch.Tensor], part_bytes: int) -> list[tuple[int, int]]:
    """``values`` cut into consecutive runs [start, stop) of at least ``part_bytes`` bytes each
    (the last may be smaller); one run for ``part_bytes`` 0."""
    if part_bytes <= 0 or not values:
        return [(0, len(values))]
    runs, start, size = [], 0, 0
    for i, v in enumerate(values):
        size += v.numel() * v.element_size()
        if size >= part_bytes:
            runs.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(values):
        runs.append((start, len(values)))
    return runs
