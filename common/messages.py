"""The typed bodies of the wire protocol's messages (``common/protocol.py`` frames them).

Each op's request and reply body is a frozen dataclass, checked against its annotations in one
place on receipt (``Body.from_wire``), so handlers never look into a raw dict and a wrong field or
type is a ``malformed`` error reply, never a crash.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from wavelet.common.protocol import BadReply, ErrorCode, Header, Op, ProtocolError, check_type


@dataclass(frozen=True)
class Body:
    """Base of typed message bodies. Unknown fields and wrong types are malformed messages."""

    @classmethod
    def from_wire(cls, data: dict[str, Any], what: str = "") -> Any:
        what = what or cls.__name__
        hints = _hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ProtocolError(
                ErrorCode.MALFORMED, f"{what}: unknown field {unknown[0]!r}; known: {names}"
            )
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ProtocolError(ErrorCode.MALFORMED, f"{what} needs body.{f.name}")
                continue
            kwargs[f.name] = _body_value(hints[f.name], data[f.name], f"{what}: body.{f.name}")
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ProtocolError(ErrorCode.MALFORMED, f"{what}: {e}") from None

    def to_wire(self) -> dict[str, Any]:
        # a body holds numbers, strings, lists and dicts, never another dataclass: no need for
        # dataclasses.asdict's recursion through every value, several times slower per message
        return {name: _copied(getattr(self, name)) for name in _names(type(self))}


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _copied(value: Any) -> Any:
    """A list's or dict's copy (the message keeps what it had when made), else the value."""
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A body's field types, resolved once: every message read needs them (resolving the
    string annotations anew took a tenth of a millisecond per message)."""
    return typing.get_type_hints(cls)


def _body_value(kind: Any, value: Any, what: str) -> Any:
    origin = typing.get_origin(kind)
    try:
        if origin is list:
            (item,) = typing.get_args(kind)
            return [check_type(v, item, what + " item") for v in check_type(value, list, what)]
        if origin is dict or kind is dict:
            return check_type(value, dict, what)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return check_type(value, kind, what)
    except TypeError as e:
        raise ProtocolError(ErrorCode.MALFORMED, str(e)) from None


@dataclass(frozen=True)
class RegisterRequest(Body):
    resume: bool = False  # join at the clock the shard kept for this wave (a resumed job)
    exact: bool = False  # join at exactly the header's clock (re-joining a restarted shard)


@dataclass(frozen=True)
class InitRequest(Body):
    trainable: list[bool]  # one flag per key: trained by the optimizer, or a buffer
    wire: list[str] = field(default_factory=list)  # per key, the dtype it travels in
    # per key, the dimensions of the tensor it was cut from (chunks are flat): the optimizer's
    # weight_decay_on tells matrices from biases by them; empty: all taken as matrices
    ndims: list[int] = field(default_factory=list)
    version: int = 0  # the version these weights carry (a wave seeding a standby that took over)


@dataclass(frozen=True)
class PullRequest(Body):
    observer: bool = False  # evaluation and tools: read the current weights, never park
    master: bool = False  # observers: the master weights in full precision, not the wire copy
    shm: bool = False  # answer through the wave's pull segment, not tensor frames
    part_bytes: int = 0  # tensor frames in messages of about this many bytes, in order (0: one)

    def __post_init__(self) -> None:
        _check_part_bytes(self.part_bytes)


@dataclass(frozen=True)
class PushRequest(Body):
    lr_scale: float = 1.0  # the job's learning-rate schedule at this clock
    shm: bool = False  # the gradients are in the wave's push segment, not in tensor frames
    skip: bool = False  # no gradients this clock (fp16 overflow): the clock passes, nothing else
    part_bytes: int = 0  # the weights that come back: as PullRequest.part_bytes
    # keys of trainable chunks whose parameters got no gradient (not used by this step's loss):
    # zeros travel in their place, and the shard leaves them out of the update, as torch's
    # optimizers skip a parameter whose .grad is None (no weight decay, no momentum step)
    absent: list[int] = field(default_factory=list)
    samples: int = 0  # samples of this step's batch (a synchronous sum weighs by them)
    compute_s: float = 0.0  # the wave's last forward and backward, in seconds (its speed)
    # samples of the batch compute_s measured: the step before this one, whose size differs
    # where batches are balanced (0: this push's samples)
    compute_samples: int = 0
    # the wave's last step besides computing and waiting (the wire, the loop): 0 not measured
    overhead_s: float = 0.0
    # over TCP, a push may come in parts (ps/push_parts.py): more parts of this push follow;
    # only the last is answered, for the whole push
    more: bool = False

    def __post_init__(self) -> None:
        if self.samples < 0 or self.compute_samples < 0:
            raise ValueError("samples and compute_samples must be >= 0")
        if not self.compute_s >= 0 or not self.overhead_s >= 0:
            raise ValueError("compute_s and overhead_s must be >= 0")
        if math.isinf(self.compute_s) or math.isinf(self.overhead_s):
            raise ValueError("compute_s and overhead_s must be finite")
        if self.skip and self.shm:
            raise ValueError("a skipped step carries no gradients, in frames or a segment")
        if self.more and (self.skip or self.shm):
            raise ValueError("only a push of tensor frames comes in parts")
        if self.skip and self.absent:
            raise ValueError("a skipped step carries no gradients to leave out")
        if not 0.0 <= self.lr_scale <= 1.0:
            raise ValueError(f"lr_scale must be a number in [0, 1], got {self.lr_scale!r}")
        _check_part_bytes(self.part_bytes)


def _check_part_bytes(part_bytes: int) -> None:
    if part_bytes < 0:
        raise ValueError(f"part_bytes must be >= 0 (0: one message), got {part_bytes!r}")


@dataclass(frozen=True)
class HeartbeatRequest(Body):
    waves: list[int]  # indices of the sending worker's live waves


@dataclass(frozen=True)
class EmptyRequest(Body):
    pass


@dataclass(frozen=True)
class AttachRequest(Body):
    transport: str = "shm"  # shm: make this wave's segments; tcp: drop them
    # the wave's own parameter memory (worker/wave_memory.py) for the shard to write pulled
    # weights into: its process and descriptor, size and nonce, and the byte offset there of
    # each of this shard's trainable chunks, in plan order; pid 0: none offered
    memory_pid: int = 0
    memory_fd: int = -1
    memory_size: int = 0
    memory_nonce: str = ""
    memory_offsets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.transport not in ("shm", "tcp"):
            raise ValueError(f"transport must be shm or tcp, got {self.transport!r}")
        if self.memory_pid < 0 or self.memory_size < 0:
            raise ValueError("memory_pid and memory_size must be >= 0")
        if any(not isinstance(o, int) or o < 0 for o in self.memory_offsets):
            raise ValueError("memory_offsets must be byte offsets >= 0")


@dataclass(frozen=True)
class AdminRequest(Body):
    token: str = ""  # the shard's admin token (run dir's admin.token), for checkpoint/shutdown


@dataclass(frozen=True)
class Seed(Body):
    """A primary's whole state for its standby (ps/replication.py); tensors follow as frames."""

    token: str  # the job's admin token: only a shard of the job may seed a standby
    state: dict[str, Any]  # the shard's state dict, tensors replaced by their frame index
    clocks: list[list]  # [worker, wave, clock] of every wave, as committed by updates
    promote: bool = False  # the primary is stopping: take the shard over now
    # with ``promote``: the open synchronous steps (ps/synchronous.py), tensors as in ``state``;
    # ``clocks`` then count the pushes in them
    open_steps: dict[str, Any] = field(default_factory=dict)
    hello: bool = False  # no state: the primary says who it is (shard_replicas = 1)


@dataclass(frozen=True)
class ReplicaUpdate(Body):
    """One update a primary applied: its gradients (``keys``, in order) and the buffers'
    values (``buffers``) as frames, the lr it used and the version it reached."""

    token: str
    version: int
    lr_scale: float
    keys: list[int]
    buffers: list[int]
    clocks: list[list]


@dataclass(frozen=True)
class DescribeRequest(Body):
    token: str = ""  # the job's admin token: joining a job is for those who run it


@dataclass(frozen=True)
class JobDescription(Body):
    """What a worker joining a running job needs (``wavelet worker --join``)."""

    job: dict[str, Any]  # the JobConfig, as a dict
    shards: list[str]  # every shard's address now, in shard order
    rank: int  # a worker slot: one whose waves left the job, else a new one
    num_workers: int  # the slot's data part is rank of num_workers


REQUEST_BODIES: dict[str, type[Body]] = {
    Op.REGISTER: RegisterRequest,
    Op.INIT: InitRequest,
    Op.PULL: PullRequest,
    Op.PUSH: PushRequest,
    Op.PUSH_PULL: PushRequest,
    Op.LEAVE: EmptyRequest,
    Op.HEARTBEAT: HeartbeatRequest,
    Op.ATTACH: AttachRequest,
    Op.STATS: EmptyRequest,
    Op.CHECKPOINT: AdminRequest,
    Op.SHUTDOWN: AdminRequest,
    Op.SEED: Seed,
    Op.REPLICATE: ReplicaUpdate,
    Op.DESCRIBE: DescribeRequest,
}


def request_body(header: Header) -> Any:
    """The typed body of a request; raises ``ProtocolError`` for an unknown op or a bad body."""
    cls = REQUEST_BODIES.get(header.op)
    if cls is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_OP,
            f"unknown op {header.op!r}; known: " + ", ".join(str(o) for o in REQUEST_BODIES),
        )
    return cls.from_wire(header.body, str(header.op))


@dataclass(frozen=True)
class Ack(Body):
    version: int  # the shard's version when it answered


@dataclass(frozen=True)
class RegisterReply(Body):
    version: int
    clock: int  # the clock the shard placed this wave at
    initialized: bool  # False: the shard holds no weights yet and needs an init
    lost_updates: int = 0  # updates this shard lost to a restart from an older checkpoint
    standby: str = ""  # where this shard's standby listens, to go to if it is lost ("": none)


@dataclass(frozen=True)
class InitReply(Body):
    version: int
    seeded: bool  # this init seeded the shard (False: it already held weights)


@dataclass(frozen=True)
class PushReply(Body):
    version: int
    action: str  # what became of the gradient: applied, dropped, accumulated, skipped


@dataclass(frozen=True)
class WeightsReply(Body):
    version: int  # the version every tensor of this reply carries
    clock: int
    parked_s: float  # how long the staleness bound held the read back
    slowest_clock: int  # slowest live wave's clock when the read was served (-1: none)
    action: str = ""  # with push_pull: what became of the pushed gradient
    shm: bool = False  # the weights are in the wave's pull segment, not in tensor frames
    # Weights asked for in parts come as ``parts`` messages, numbered from 0, each with its run
    # of the shard's chunks (header.keys) in the shard's order: the model's, forward first.
    part: int = 0
    parts: int = 1
    batch: int = 0  # the batch this wave should take next (balanced batches; 0: unchanged)
    slot: int = -1  # shm: the weight slot with the trainable chunks (-1: all in the pull segment)
    in_wave_memory: bool = False  # shm: the trainable chunks are already in the wave's memory

    def __post_init__(self) -> None:
        if not 0 <= self.part < self.parts:
            raise ValueError(f"part {self.part} of {self.parts}: parts are numbered 0..parts-1")


@dataclass(frozen=True)
class AttachReply(Body):
    version: int
    transport: str  # what the shard will use for this wave: shm or tcp
    push_segment: str = ""  # file names in the shared-memory folder (/dev/shm)
    pull_segment: str = ""
    nonce: str = ""  # written into both segments' first bytes: proves the client opened them
    size: int = 0  # bytes of each segment
    offsets: list[int] = field(default_factory=list)  # byte offset of each chunk, plan order
    reason: str = ""  # why the shard offers TCP (no space for segments, --no-shm)
    # the shard's weight slots (ps/weight_slots.py): its trainable chunks in their own dtype,
    # read in place; none where the shard could not make them (then the pull segment has all)
    weight_slots: list[str] = field(default_factory=list)
    weight_nonce: str = ""
    weight_size: int = 0
    weight_offsets: list[int] = field(default_factory=list)  # per trainable chunk, plan order
    # the shard writes pulled weights into the wave's own memory (AttachRequest.memory_*);
    # if offered and refused, why
    wave_memory: bool = False
    memory_reason: str = ""


@dataclass(frozen=True)
class CheckpointReply(Body):
    version: int
    path: str


@dataclass(frozen=True)
class StatsReply(Body):
    version: int
    shard: int
    update_rule: str  # how pushes become updates: "staleness bound 1", "wave turns", ...
    parked_now: int
    rejected: int
    checkpoint_failures: int
    waves: dict[str, Any]
    members: dict[str, int] = field(default_factory=dict)  # epoch, live, joins, leaves
    # pulls through shared memory: written into the wave's own memory, read in place from a
    # weight slot, or copied into the wave's segment; and how often the weights moved slots
    # before an update (ps/weight_slots.py)
    shm_reads: dict[str, int] = field(default_factory=dict)
    # how the waves' batches are sized now ("balanced batches (waves 1.3x apart)"; "": the
    # job's); said by shard 0 alone, whose replies the waves take their batch from
    batches: str = ""


REPLY_BODIES: dict[str, type[Body]] = {
    Op.REGISTER: RegisterReply,
    Op.INIT: InitReply,
    Op.PULL: WeightsReply,
    Op.PUSH: PushReply,
    Op.PUSH_PULL: WeightsReply,
    Op.LEAVE: Ack,
    Op.HEARTBEAT: Ack,
    Op.ATTACH: AttachReply,
    Op.STATS: StatsReply,
    Op.CHECKPOINT: CheckpointReply,
    Op.SHUTDOWN: Ack,
    Op.SEED: Ack,
    Op.REPLICATE: Ack,
    Op.DESCRIBE: JobDescription,
}


def reply_body(op: str, header: Header) -> Any:
    """The typed body of a reply to ``op`` (a malformed one raises ``BadReply``)."""
    try:
        return REPLY_BODIES[op].from_wire(header.body, f"reply to {op}")
    except ProtocolError as e:
        raise BadReply(f"unreadable reply: {e.message}") from None


def reply_header(request_id: int, body: Body) -> Header:
    return Header(op=Op.REPLY, request_id=request_id, body=body.to_wire())
