"""One shard's state: its chunks of the model, the server-side optimizer, and the version counter.

No networking here (that is ``ps/server.py``; the rules are ``ps/service.py``): the shard validates
what it is given and changes its parameters only once a whole push has been validated, so a bad
request never leaves half an update.

The shard keeps master weights and optimizer state in the dtype the model has (fp32). With a
16-bit wire, gradients arrive in 16 bits and are applied in fp32, and the 16-bit copy of the
weights is made once per change of state and served to every reader (``wire_values``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from wavelet.common.optimizer import OptimizerConfig
from wavelet.common.protocol import ErrorCode, ProtocolError, TensorDesc
from wavelet.ps.finite import first_non_finite


@dataclass(frozen=True)
class ChunkSpec:
    key: int
    desc: TensorDesc  # as the shard keeps it (master weights)
    trainable: bool
    wire: TensorDesc  # as it travels
    ndim: int = 2  # of the tensor it was cut from (weight_decay_on tells matrices by it)


def _wire_dtype_allowed(master: torch.dtype, wire: torch.dtype) -> bool:
    """A chunk travels in its own dtype, or a float32 one in 16 bits."""
    return wire == master or (master == torch.float32 and wire in (torch.bfloat16, torch.float16))


# sequential statistics: how many versions back a wave's read is known (older: served as is)
STATISTICS_HISTORY = 64


class Shard:
    """Parameters and optimizer state for the chunks the sharding plan gives this shard.

    Trainable chunks are updated by the optimizer. Buffers (BatchNorm running statistics, other
    persistent buffers; frozen parameters are not planned) are not trained: each wave uploads its
    current values with every push and a pull returns their mean over the waves that uploaded,
    each weighed by the samples of the push it came with (integer buffers such as
    ``num_batches_tracked`` take the maximum), so evaluation sees statistics from all the data.
    The weights matter where batches differ (balanced batches): a wave cut to a few samples
    estimates its running mean from those few, and counted like the others its noise filled the
    mean; weighed, one step of every wave moves a running mean as one process's step on their
    concatenated batches does.

    Under a synchronous rule (``statistics = "step"``) the mean is over the waves whose uploads
    read the version before the current one: the waves of the step that made it, where they
    read the same statistics, as under wave turns, where each group reads the other's update.
    Their mean is then one process's step on their batches, where a mean over every wave mixed
    in the other group's statistics of the step before, and the served running means followed
    the model about 1.5x more slowly than one process's (or all-reduce's) do. Where no upload
    read that version (wave groups, before the first update), every wave's counts.

    Under asynchronous waves (``statistics = "sequential"``) an upload is a step of its own: the
    served statistics move by what the wave's step changed in the statistics it read (its upload
    less the values served at the version it read), as one process's running mean moves batch
    by batch. A mean over every wave's latest upload followed the model more slowly the more
    waves there were: with two, a root of 0.93 per push where one process has 0.9 (as a
    BatchNorm momentum of 0.067 for 0.1: 1.045x the samples to 60%,
    ``benchmarks/bench_bn_tracking.py``), with four 0.96. A wave that read a version older than
    the last ``STATISTICS_HISTORY`` has its values served as they are.
    """

    def __init__(
        self, optimizer: OptimizerConfig, weights_in_use: Callable[[], bool] = lambda: False
    ):
        self.optimizer_config = optimizer
        self.weights_in_use = weights_in_use
        self.detached = 0  # updates that first moved the parameters to fresh memory
        self.plan = ""
        self.specs: list[ChunkSpec] = []
        self.params: dict[int, torch.nn.Parameter] = {}
        self.buffers: dict[int, torch.Tensor] = {}  # initial values, until a wave uploads its own
        self.wave_buffers: dict[object, dict[int, torch.Tensor]] = {}
        self.buffer_samples: dict[object, int] = {}  # each upload's push's samples (0: untold)
        self.buffer_reads: dict[object, int] = {}  # the version each upload's push read
        # how uploads make the served statistics (see above): "mean" of every wave's latest,
        # "step": of the latest step's waves (synchronous rules), "sequential": each in turn
        # (asynchronous waves); the update rule sets it
        self.statistics = "mean"
        # sequential statistics: the served buffers as of each recent version (what a wave that
        # read it started from)
        self.served_at: dict[int, dict[int, torch.Tensor]] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.version = 0  # updates applied
        self.changes = 0  # updates and buffer uploads: what a cached wire copy is valid for
        self.wire_casts = 0  # 16-bit copies made of the weights (one per change read)
        self._wire_copy: tuple[int, list[torch.Tensor]] | None = None
        self._all_native = True  # every chunk travels in its own dtype (set by initialize)
        self._params_sent_as_is = True  # some parameter travels in its own dtype
        # shared memory the parameters live in for local waves' copy-free reads
        # (ps/weight_slots.py): set by the data path once a wave attaches through it
        self.memory = None
        # called after every update with its gradients and lr (the primary's replicator)
        self.on_apply: Callable[[dict[int, torch.Tensor], float], None] | None = None

    @property
    def initialized(self) -> bool:
        return bool(self.plan)

    @property
    def keys(self) -> list[int]:
        return [s.key for s in self.specs]

    def initialize(
        self,
        plan: str,
        keys: Sequence[int],
        values: Sequence[torch.Tensor],
        trainable: Sequence[bool],
        wire: Sequence[str] = (),
        ndims: Sequence[int] = (),
        version: int = 0,
    ) -> bool:
        """Seed the shard from a wave's initial weights (full precision, with the dtype each
        chunk travels in: ``wire``, default its own, and the dimensions of the tensor each was
        cut from: ``ndims``, default 2), at the ``version`` they carry (0 for a new job; a wave
        seeding a standby that took over with nothing gives the version it last read);
        returns False if it already was seeded."""
        if self.initialized:
            self.check_plan(plan)
            return False
        if not plan:
            raise ProtocolError(ErrorCode.MALFORMED, "init needs the plan fingerprint")
        if not (len(keys) == len(values) == len(trainable)):
            raise ProtocolError(ErrorCode.MALFORMED, "init needs one tensor and flag per key")
        if len(set(keys)) != len(keys):
            raise ProtocolError(ErrorCode.MALFORMED, "init names a key twice")
        for v, t in zip(values, trainable, strict=True):
            if t and not v.is_floating_point():
                raise ProtocolError(ErrorCode.BAD_DTYPE, "trainable chunks must be floating point")
            if v.dim() != 1:
                raise ProtocolError(ErrorCode.BAD_SHAPE, "chunks travel as 1-D tensors")
        wire = list(wire) or [TensorDesc.of(v).dtype for v in values]
        if len(wire) != len(values):
            raise ProtocolError(ErrorCode.MALFORMED, "init needs one wire dtype per key")
        ndims = list(ndims) or [2] * len(values)
        if len(ndims) != len(values) or any(n < 0 for n in ndims):
            raise ProtocolError(
                ErrorCode.MALFORMED, "init needs one number of dimensions (>= 0) per key"
            )
        wire_descs = []
        for v, w in zip(values, wire, strict=True):
            try:
                desc = TensorDesc(w, tuple(v.shape))
                allowed = _wire_dtype_allowed(v.dtype, desc.torch_dtype)
            except KeyError:
                allowed = False
            if not allowed:
                raise ProtocolError(
                    ErrorCode.BAD_DTYPE,
                    f"a {v.dtype} chunk cannot travel as {w!r}: only float32 ones may travel "
                    "in bfloat16 or float16",
                )
            wire_descs.append(desc)
        self.specs = [
            ChunkSpec(k, TensorDesc.of(v), bool(t), w, n)
            for k, v, t, w, n in zip(keys, values, trainable, wire_descs, ndims, strict=True)
        ]
        # fixed by the plan: whether replies carry this memory itself or 16-bit copies of it
        self._all_native = all(s.wire == s.desc for s in self.specs)
        self._params_sent_as_is = any(s.wire == s.desc for s in self.specs if s.trainable)
        for spec, value in zip(self.specs, values, strict=True):
            if spec.trainable:
                self.params[spec.key] = torch.nn.Parameter(value.clone())
            else:
                self.buffers[spec.key] = value.clone()
        # a shard the plan gave no trainable chunk (more shards than chunks) has nothing to
        # optimise; its pushes still count, as versions, so that clocks and bounds agree
        if self.params:
            trained = [s.ndim for s in self.specs if s.trainable]
            self.optimizer = self.optimizer_config.build(list(self.params.values()), ndims=trained)
        self.plan = plan
        self.version = max(0, version)
        self._remember_statistics(fresh=True)
        return True

    def check_plan(self, plan: str) -> None:
        if not self.initialized:
            raise ProtocolError(
                ErrorCode.NOT_INITIALIZED, "shard holds no parameters yet; a wave must init it"
            )
        if plan != self.plan:
            raise ProtocolError(
                ErrorCode.PLAN_MISMATCH,
                "sharding plan differs from this shard's: workers and shards must use the "
                "same model (with the same values of its frozen parameters), shard count "
                "and chunk size",
            )

    def check_push(self, keys: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Raise unless ``tensors`` are exactly this shard's chunks, well-formed and finite."""
        if list(keys) != self.keys:
            unknown = sorted(set(keys) - set(self.keys))
            if unknown:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_KEY, f"key {unknown[0]} is not held by this shard"
                )
            raise ProtocolError(
                ErrorCode.PLAN_MISMATCH,
                f"push must carry this shard's {len(self.keys)} chunks in plan order, "
                f"got {len(keys)}",
            )
        for spec, t in zip(self.specs, tensors, strict=True):
            if t.dtype != spec.wire.torch_dtype:
                raise ProtocolError(
                    ErrorCode.BAD_DTYPE,
                    f"key {spec.key}: dtype {t.dtype} where {spec.wire.dtype} is expected (the "
                    "job's wire_dtype: every wave and shard of a job must use the same)",
                )
            if tuple(t.shape) != spec.desc.shape:
                raise ProtocolError(
                    ErrorCode.BAD_SHAPE,
                    f"key {spec.key}: shape {list(t.shape)} where {list(spec.desc.shape)} "
                    "is expected",
                )
        bad = first_non_finite(tensors)
        if bad is not None:
            spec = self.specs[bad]
            kind = "gradient" if spec.trainable else "buffer"
            raise ProtocolError(
                ErrorCode.NON_FINITE,
                f"key {spec.key}: {kind} holds NaN or Inf; nothing was applied",
            )

    def check_absent(self, absent: Sequence[int]) -> None:
        """Raise unless ``absent`` names distinct trainable chunks of this shard."""
        for key in absent:
            if key not in self.params:  # the trainable chunks
                raise ProtocolError(
                    ErrorCode.UNKNOWN_KEY,
                    f"push says key {key} has no gradient, but it is not a trainable chunk "
                    "of this shard",
                )
        if len(set(absent)) != len(absent):
            raise ProtocolError(ErrorCode.MALFORMED, "push names a chunk without gradient twice")

    def gradients(
        self, tensors: Sequence[torch.Tensor], absent: Sequence[int] = ()
    ) -> dict[int, torch.Tensor]:
        """The trainable chunks' gradients, in the master dtype (16-bit ones are widened),
        leaving out the ``absent`` ones (parameters the wave's loss did not use)."""
        skip = set(absent)
        return {
            s.key: t.to(s.desc.torch_dtype)
            for s, t in zip(self.specs, tensors, strict=True)
            if s.trainable and s.key not in skip
        }

    def store_buffers(
        self, wave: object, tensors: Sequence[torch.Tensor], samples: int = 0, read: int = -1
    ) -> None:
        """Keep ``wave``'s buffer values (copied: the frames they arrived in are released),
        measured on a batch of ``samples`` (0: not told) from the version ``read``."""
        values = {
            s.key: t.to(s.desc.torch_dtype, copy=True)
            for s, t in zip(self.specs, tensors, strict=True)
            if not s.trainable
        }
        if values and self.statistics == "sequential":
            base = self.served_at.get(read, {})
            for key, value in values.items():
                old = base.get(key)
                self.buffers[key] = value if old is None else self.buffers[key] + (value - old)
            self.changes += 1
        elif values:
            self.wave_buffers[wave] = values
            self.buffer_samples[wave] = max(0, samples)
            self.buffer_reads[wave] = read
            self.changes += 1

    def forget_wave(self, wave: object) -> None:
        """``wave`` left: its buffer values (BatchNorm statistics) no longer count in the mean.
        Where it was the last to upload a key, its values stay as the key's base value."""
        values = self.wave_buffers.pop(wave, None) or {}
        self.buffer_samples.pop(wave, None)
        self.buffer_reads.pop(wave, None)
        if values:  # the mean of the buffers changes: a cached wire copy is stale
            self.changes += 1
        for key, value in values.items():
            if not any(key in b for b in self.wave_buffers.values()):
                self.buffers[key] = value

    def _remember_statistics(self, fresh: bool = False) -> None:
        """Sequential statistics: keep the served buffers of this version, for the uploads of
        the waves that read it (``fresh``: the buffers were set anew, forget the older ones)."""
        if fresh:
            self.served_at.clear()
        if self.statistics != "sequential":
            return
        self.served_at[self.version] = {k: v.clone() for k, v in self.buffers.items()}
        self.served_at.pop(self.version - STATISTICS_HISTORY, None)

    def apply(self, grads: dict[int, torch.Tensor], lr_scale: float = 1.0) -> None:
        """One optimizer step with ``grads`` (already validated); bumps the version. A chunk
        without a gradient there keeps ``.grad = None``, which torch's optimizers skip."""
        if self.optimizer is None:  # no trainable chunks here
            self.version += 1
            self.changes += 1
            self._remember_statistics()
            return
        self._own_weights()
        for key, p in self.params.items():
            p.grad = grads.get(key)
        if lr_scale != 1.0:
            saved = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * lr_scale
        self.optimizer.step()
        if lr_scale != 1.0:
            for g, lr in zip(self.optimizer.param_groups, saved, strict=True):
                g["lr"] = lr
        for p in self.params.values():
            p.grad = None
        self.version += 1
        self.changes += 1
        self._remember_statistics()
        if self.on_apply is not None:
            self.on_apply(grads, lr_scale)

    def _own_weights(self) -> None:
        """Replies still being sent point at the parameters' memory (zero copy). Rather than wait
        for them (a client that never reads would stall the shard), move the parameters to fresh
        memory: those replies keep the old memory, and the version they were sent with, until
        ZeroMQ lets go of it. Optimizer state stays keyed by the same Parameter objects.
        With a 16-bit wire, replies carry copies (``wire_values``), never this memory. Where
        local waves read the parameters in place (``memory``), the slot a wave still reads is
        not written either."""
        params = list(self.params.values())
        busy = self._params_sent_as_is and self.weights_in_use()
        if not busy and (self.memory is None or self.memory.make_writable(params)):
            return
        for p in params:
            p.data = p.data.clone()
        self.detached += 1

    def values(self) -> list[torch.Tensor]:
        """Current value of every chunk, in plan order (parameters are returned without copy)."""
        buffers = self._buffer_values()
        return [self.params[s.key].detach() if s.trainable else buffers[s.key] for s in self.specs]

    def wire_values(self) -> list[torch.Tensor]:
        """``values()`` in each chunk's wire dtype. A 16-bit copy is made once per change and
        served to every reader of it; it is never written in place (replies still sending it
        keep it alive), so it needs none of ``_own_weights``'s care."""
        if self._all_native:
            return self.values()
        if self._wire_copy is None or self._wire_copy[0] != self.changes:
            copy = [
                v.to(s.wire.torch_dtype) for s, v in zip(self.specs, self.values(), strict=True)
            ]
            self._wire_copy = (self.changes, copy)
            self.wire_casts += 1
        return self._wire_copy[1]

    def _buffer_values(self) -> dict[int, torch.Tensor]:
        """Every buffer chunk's served value (``_buffer_value``), over all buffers of a dtype at
        once where every wave that uploaded holds all of them (the usual case): the same
        arithmetic as one buffer at a time (a mean, a weighted sum over waves, a maximum) in a
        few calls instead of a few per buffer (benchmarks/bench_shard_cpu.py)."""
        by_dtype: dict[torch.dtype, list[ChunkSpec]] = {}
        for s in self.specs:
            if not s.trainable:
                by_dtype.setdefault(s.desc.torch_dtype, []).append(s)
        waves = self._serving_waves()
        uploads = [self.wave_buffers[w] for w in waves]
        out = {}
        for specs in by_dtype.values():
            if len(specs) < 2 or not uploads or any(s.key not in u for u in uploads for s in specs):
                out.update((s.key, self._buffer_value(s)) for s in specs)
                continue
            stacked = torch.stack([torch.cat([u[s.key] for s in specs]) for u in uploads])
            flat = self._mean_over_waves(stacked, waves)
            sizes = [s.desc.numel for s in specs]
            out.update(zip((s.key for s in specs), torch.split(flat, sizes), strict=True))
        return out

    def _serving_waves(self) -> list:
        """The waves whose uploads a pull serves: under "step" statistics, those that read the
        version before this one (the step that made it), where any did; else all."""
        if self.statistics == "step":
            made = [w for w, read in self.buffer_reads.items() if read == self.version - 1]
            if made:
                return made
        return list(self.wave_buffers)

    def _mean_over_waves(self, stacked: torch.Tensor, waves: list) -> torch.Tensor:
        """Row i of ``stacked`` is ``waves[i]``'s: their samples-weighted mean (the plain mean
        where the samples are equal or untold; the maximum for integers)."""
        if not stacked.is_floating_point():
            return stacked.max(0).values
        samples = [self.buffer_samples.get(w, 0) for w in waves]
        if 0 in samples or len(set(samples)) == 1:  # untold, or equal: the plain mean
            return stacked.mean(0)
        weights = torch.tensor(samples, dtype=stacked.dtype) / sum(samples)
        return torch.tensordot(weights, stacked, dims=1)

    def _buffer_value(self, spec: ChunkSpec) -> torch.Tensor:
        waves = [w for w in self._serving_waves() if spec.key in self.wave_buffers[w]]
        if not waves:
            return self.buffers[spec.key]
        stacked = torch.stack([self.wave_buffers[w][spec.key] for w in waves])
        return self._mean_over_waves(stacked, waves)

    def buffer_value(self, key: int) -> torch.Tensor:
        """The value a pull serves for buffer chunk ``key``."""
        return self._buffer_value(next(s for s in self.specs if s.key == key))

    def set_buffer(self, key: int, value: torch.Tensor) -> None:
        """Buffer chunk ``key``'s value, as the primary serves it (a standby kept in step)."""
        if key not in self.buffers:
            raise ProtocolError(ErrorCode.UNKNOWN_KEY, f"key {key} is no buffer of this shard")
        self.buffers[key] = value.to(self.buffers[key].dtype, copy=True)
        self.wave_buffers.clear()
        self.buffer_samples.clear()
        self.buffer_reads.clear()
        if self.version in self.served_at:  # what a wave reading this version is served
            self.served_at[self.version][key] = self.buffers[key].clone()
        self.changes += 1

    def reload(self, state: dict) -> None:
        """Take a newer ``state_dict`` of this same shard (a standby seeded again)."""
        if list(state["keys"]) != self.keys:
            raise ProtocolError(ErrorCode.PLAN_MISMATCH, "a seed for other chunks than these")
        self._own_weights()  # written in place below, as an update
        for spec, value in zip(self.specs, state["values"], strict=True):
            if spec.trainable:
                self.params[spec.key].data.copy_(value)
            else:
                self.buffers[spec.key] = value.clone()
        self.wave_buffers.clear()
        self.buffer_samples.clear()
        self.buffer_reads.clear()
        self.version = state["version"]
        if state["optimizer"] is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self._remember_statistics(fresh=True)
        self.changes += 1

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved (a restarted shard resuming from its checkpoint)."""
        self.initialize(
            state["plan"],
            state["keys"],
            state["values"],
            state["trainable"],
            state.get("wire", ()),  # checkpoints before 16-bit wires: every chunk its own dtype
            state.get("ndims", ()),  # checkpoints before weight_decay_on: all as matrices
        )
        self.version = state["version"]
        if state["optimizer"] is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self._remember_statistics(fresh=True)

    def state_dict(self) -> dict:
        return {
            "plan": self.plan,
            "version": self.version,
            "keys": self.keys,
            "values": [v.clone() for v in self.values()],
            "trainable": [s.trainable for s in self.specs],
            "wire": [s.wire.dtype for s in self.specs],
            "ndims": [s.ndim for s in self.specs],
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
        }
