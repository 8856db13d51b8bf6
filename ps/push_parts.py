"""A push over TCP in parts: a wave sends each run of a shard's gradients as soon as backward has
made it (worker/rounds.py), so that the bytes cross the link while backward goes on and only the
last part, the first layers', is left for after it. The shard keeps the parts and treats the
last one (``PushRequest.more`` false) as the whole push: validated whole, applied whole, or
refused whole, exactly as a push in one message. A part is never answered; whatever is wrong
with one is said in the answer to the last.

At most one push in parts per wave, of at most this shard's chunks, so what the parts hold is
bounded by (registered waves) x (this shard's bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from wavelet.common.protocol import ErrorCode, ProtocolError
from wavelet.ps.staleness import WaveId


@dataclass
class _Parts:
    clock: int
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk key -> gradient
    broken: str = ""  # why the push cannot be whole, said when its last part comes


class PushParts:
    """The parts so far of each wave's push; ``held()``: this shard's chunk keys, plan order."""

    def __init__(self, held: Callable[[], list[int]]):
        self.held = held
        self.waves: dict[WaveId, _Parts] = {}

    def add(self, wave: WaveId, clock: int, keys: list[int], tensors: list[torch.Tensor]) -> None:
        """Keep one part (not the last) of ``wave``'s push for ``clock``; a part of another
        clock starts afresh (the wave gave the earlier push up)."""
        parts = self.waves.get(wave)
        if parts is None or parts.clock != clock:
            parts = self.waves[wave] = _Parts(clock)
        if parts.broken:
            return
        held = set(self.held())
        if len(keys) != len(tensors):
            parts.broken = f"a part named {len(keys)} chunks and carried {len(tensors)} tensors"
        elif any(k not in held for k in keys):
            stranger = next(k for k in keys if k not in held)
            parts.broken = f"a part carried key {stranger}, which this shard does not hold"
        elif len(set(keys)) != len(keys) or any(k in parts.tensors for k in keys):
            parts.broken = "a part carried a chunk twice"
        if parts.broken:
            parts.tensors.clear()
            return
        parts.tensors.update(zip(keys, tensors, strict=True))

    def whole(
        self, wave: WaveId, clock: int, keys: list[int], tensors: list[torch.Tensor]
    ) -> tuple[list[int], list[torch.Tensor]]:
        """The whole push whose last part this is, in plan order (the last part alone where no
        earlier part came); ProtocolError where a part was wrong."""
        parts = self.waves.pop(wave, None)
        if parts is None or parts.clock != clock or len(keys) == len(self.held()):
            return keys, tensors  # one message (a push sent again whole, after a recovery)
        if parts.broken:
            raise ProtocolError(ErrorCode.MALFORMED, f"push in parts: {parts.broken}")
        if len(keys) != len(tensors) or any(k in parts.tensors for k in keys):
            raise ProtocolError(
                ErrorCode.MALFORMED, "push in parts: its last part repeats or miscounts chunks"
            )
        parts.tensors.update(zip(keys, tensors, strict=True))
        ordered = [k for k in self.held() if k in parts.tensors]
        if len(ordered) != len(parts.tensors):  # a key the shard does not hold: check_push says
            return list(parts.tensors), list(parts.tensors.values())
        return ordered, [parts.tensors[k] for k in ordered]

    def forget(self, wave: WaveId) -> None:
        self.waves.pop(wave, None)
