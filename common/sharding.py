"""The sharding plan: which slice of which tensor lives on which parameter-server shard.

Tensors are flattened and cut into chunks of at most ``chunk_bytes``. Placements
(``PLACEMENTS``): ``size`` assigns chunks greedily, largest first, each to the shard holding the
fewest bytes so far; ``layers`` cuts the model, in the order of its tensors, into one contiguous
run of about equal bytes per shard, so that backward finishes the last shard's gradients first
and the wave can push to it while backward goes on (worker/push_hooks.py). The plan depends only
on the model's tensors (names, dtypes, sizes, order), the shard count, the chunk size and the
placement, so every process computes the same plan, and its fingerprint lets a shard refuse a
push from another plan.

A plan also says in which dtype each chunk travels (``wire``): the job's wire dtype for float32
chunks, its own dtype for every other. The wire dtype is part of the fingerprint, so a wave of a
bf16 job and a shard seeded by an fp32 one refuse each other at once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from wavelet.common.config import PLACEMENTS, JobConfig
from wavelet.common.protocol import TensorDesc, dtype_name

# the job's ``wire_dtype`` setting -> the dtype name chunks travel in
WIRE_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Chunk:
    """A contiguous slice ``[offset, offset + numel)`` of one flattened model tensor."""

    key: int
    name: str
    offset: int
    numel: int
    dtype: str
    trainable: bool  # parameters are trained by gradients; buffers (BatchNorm stats) are state
    shard: int
    wire: str  # the dtype gradients and weights of this chunk travel in
    # made once (every message asks for them chunk by chunk); not in the plan's fingerprint
    desc: TensorDesc = field(init=False, repr=False, compare=False)  # as model and shard hold it
    wire_desc: TensorDesc = field(init=False, repr=False, compare=False)  # as it travels

    def __post_init__(self) -> None:
        object.__setattr__(self, "desc", TensorDesc(self.dtype, (self.numel,)))
        object.__setattr__(self, "wire_desc", TensorDesc(self.wire, (self.numel,)))

    @property
    def nbytes(self) -> int:
        return self.desc.nbytes

    @property
    def wire_nbytes(self) -> int:
        return self.wire_desc.nbytes


@dataclass(frozen=True)
class ShardingPlan:
    chunks: tuple[Chunk, ...]
    num_shards: int
    fingerprint: str

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        num_shards: int,
        chunk_bytes: int,
        wire_dtype: str = "fp32",
        placement: str = "size",
    ) -> ShardingPlan:
        plan = cls.build(model_tensors(model), num_shards, chunk_bytes, wire_dtype, placement)
        frozen = frozen_digest(model)
        if not frozen:  # a model without frozen parameters keeps the fingerprint it always had
            return plan
        fingerprint = hashlib.sha256(f"{plan.fingerprint}/{frozen}".encode()).hexdigest()[:16]
        return cls(plan.chunks, plan.num_shards, fingerprint)

    @classmethod
    def for_job(cls, model: torch.nn.Module, job: JobConfig) -> ShardingPlan:
        """The plan of ``job`` (its shards, chunk size, wire dtype and placement) for ``model``:
        what every wave and every reader of a job's shards must compute alike."""
        return cls.for_model(model, job.shards, job.chunk_bytes, job.wire, job.placement)

    @classmethod
    def build(
        cls,
        tensors: list[tuple[str, torch.Tensor, bool]],
        num_shards: int,
        chunk_bytes: int,
        wire_dtype: str = "fp32",
        placement: str = "size",
    ) -> ShardingPlan:
        """Plan for ``(name, tensor, trainable)`` triples, in the order given; float32 chunks
        travel in ``wire_dtype`` (fp32, bf16 or fp16); ``placement``: size or layers."""
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        if num_shards < 1:
            raise ValueError("a plan needs at least one shard")
        if wire_dtype not in WIRE_DTYPE_NAMES:
            raise ValueError(
                f"wire dtype must be one of {', '.join(WIRE_DTYPE_NAMES)}, got {wire_dtype!r}"
            )
        wire_of = {"float32": WIRE_DTYPE_NAMES[wire_dtype]}
        pieces: list[tuple[str, int, int, str, bool]] = []
        sizes: list[int] = []
        for name, t, trainable in tensors:
            dtype = dtype_name(t.dtype)
            per_chunk = max(1, chunk_bytes // t.element_size())
            numel = t.numel()
            for offset in range(0, max(numel, 1), per_chunk):
                n = min(per_chunk, numel - offset)
                pieces.append((name, offset, n, dtype, trainable))
                sizes.append(n * t.element_size())
        place = _by_layers if placement == "layers" else _by_size
        owner = place(sizes, num_shards)
        chunks = tuple(
            Chunk(key, name, offset, numel, dtype, trainable, owner[key], wire_of.get(dtype, dtype))
            for key, (name, offset, numel, dtype, trainable) in enumerate(pieces)
        )
        digest = hashlib.sha256(repr((num_shards, chunks)).encode()).hexdigest()[:16]
        if placement != "size":  # the size placement keeps the fingerprints it always had
            digest = hashlib.sha256(f"{digest}/{placement}".encode()).hexdigest()[:16]
        return cls(chunks, num_shards, digest)

    def for_shard(self, shard: int) -> list[Chunk]:
        return [c for c in self.chunks if c.shard == shard]

    def bytes_per_shard(self) -> list[int]:
        load = [0] * self.num_shards
        for c in self.chunks:
            load[c.shard] += c.nbytes
        return load


def _by_size(sizes: list[int], num_shards: int) -> list[int]:
    """Largest first, each to the shard holding the fewest bytes so far."""
    load = [0] * num_shards
    owner = [0] * len(sizes)
    for key in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        shard = min(range(num_shards), key=lambda s: (load[s], s))
        owner[key] = shard
        load[shard] += sizes[key]
    return owner


def _by_layers(sizes: list[int], num_shards: int) -> list[int]:
    """Contiguous runs in order: a chunk goes to the shard whose equal share of all bytes holds
    the chunk's middle byte (every shard gets a run when there are enough chunks)."""
    total = sum(sizes) or 1
    owner, before = [], 0
    for size in sizes:
        owner.append(min(num_shards - 1, (2 * before + size) * num_shards // (2 * total)))
        before += size
    return owner


def model_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """Every tensor the PS keeps for ``model``: its trainable parameters, then its persistent
    buffers. Frozen parameters (``requires_grad=False``, a pretrained backbone) never travel:
    as DDP keeps them each rank's own once it starts, they stay each wave's own, the same in
    every wave at the start (the model is built from the job's seed; ``frozen_digest`` puts
    their values in the plan's fingerprint, so a wave whose differ is refused)."""
    out = [(n, p, True) for n, p in model.named_parameters() if p.requires_grad]
    persistent = model.state_dict(keep_vars=True)
    out += [(n, b, False) for n, b in model.named_buffers() if n in persistent]
    return out


def frozen_digest(model: torch.nn.Module) -> str:
    """A digest of the names, dtypes, shapes and values of ``model``'s frozen parameters ("" if
    it has none)."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    if not frozen:
        return ""
    h = hashlib.sha256()
    for name, p in frozen:
        value = p.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}/{dtype_name(p.dtype)}/{list(p.shape)}".encode())
        h.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return h.hexdigest()[:16]


def chunk_view(tensor: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The 1-D slice of ``tensor`` that ``chunk`` names (a view: writes reach the tensor)."""
    return tensor.view(-1)[chunk.offset : chunk.offset + chunk.numel]
