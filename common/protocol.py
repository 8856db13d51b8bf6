"""The one wire protocol between waves and parameter-server shards.

A message is one ZeroMQ multipart message: frame 0 is a small msgpack header, then the raw bytes
of the tensors the header describes, in order. Tensors smaller than the header's ``pack_below``
travel together in one frame, the pack (each at a multiple of ``PACK_ALIGN`` bytes), which
follows the header when there is one; every larger tensor has a frame of its own, sent with
``copy=False``. Tensor bytes never go inside msgpack; on receipt every tensor, packed or not, is
wrapped with ``torch.frombuffer`` without a copy. Nothing here unpickles anything.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import zmq

# 2: weights answered in parts (part_bytes); 3: stats name the update rule; 4: pushes name the
# chunks they carry no gradient for (PushRequest.absent), init the parameters' dimensions;
# 5: standbys (seed, replicate; moved and not_primary errors; RegisterReply.standby);
# 6: attach offers the wave's memory (AttachRequest.memory_*), pushes in parts (more);
# 7: a push says which batch its compute_s measured (PushRequest.compute_samples);
# 8: small tensors travel packed in one frame (Header.pack_below); 9: a hand-over passes the
# open synchronous steps on (Seed.open_steps)
PROTOCOL_VERSION = 9

# A frame of its own costs a sender some microseconds in pyzmq and ZeroMQ whatever its size, and
# a tracked zero-copy frame (a shard's weight replies) several times that, where copying a small
# tensor into the pack costs less: for the narrow ResNet's 58 chunks per shard the pack cut a
# push's sending CPU to 0.63x and a weight reply's to 0.51x (benchmarks/bench_frames.py).
PACK_BELOW = 64 * 1024
PACK_ALIGN = 64  # every packed tensor starts at a multiple of this many bytes in the pack
_PAD = torch.zeros(PACK_ALIGN, dtype=torch.uint8)  # the gaps between packed tensors (read only)

# A header is small; anything bigger is a malformed or hostile message.
MAX_HEADER_BYTES = 1 << 20


class Op(enum.StrEnum):
    """Requests a shard understands, and the two kinds of reply."""

    REGISTER = "register"  # a wave joins; reply carries the shard's plan fingerprint and version
    INIT = "init"  # first caller seeds the shard's chunks; later callers must match the plan
    PULL = "pull"  # read weights (parks while the staleness bound forbids the read)
    PUSH = "push"  # gradients (and buffers) computed from the version read
    PUSH_PULL = "push_pull"  # push, then pull for the next clock, in one round trip
    LEAVE = "leave"  # a wave is done; it stops counting towards the staleness bound
    HEARTBEAT = "heartbeat"  # a worker's waves are alive (body.waves: their indices)
    ATTACH = "attach"  # a wave asks for shared-memory segments (or gives them up: transport tcp)
    STATS = "stats"  # versions, clocks, staleness histograms
    CHECKPOINT = "checkpoint"  # write a checkpoint now
    SHUTDOWN = "shutdown"  # stop the shard daemon
    SEED = "seed"  # a primary's whole state, to its standby (ps/replication.py)
    REPLICATE = "replicate"  # one update a primary applied, to its standby
    DESCRIBE = "describe"  # a joining worker asks for the job, the shards and a worker slot
    REPLY = "reply"
    ERROR = "error"


class ErrorCode(enum.StrEnum):
    MALFORMED = "malformed"
    BAD_PROTOCOL_VERSION = "bad_protocol_version"
    UNKNOWN_OP = "unknown_op"
    NOT_INITIALIZED = "not_initialized"
    NOT_REGISTERED = "not_registered"
    NOT_ATTACHED = "not_attached"
    PLAN_MISMATCH = "plan_mismatch"
    UNKNOWN_KEY = "unknown_key"
    BAD_SHAPE = "bad_shape"
    BAD_DTYPE = "bad_dtype"
    NON_FINITE = "non_finite"
    FUTURE_VERSION = "future_version"
    STALE_CLOCK = "stale_clock"
    SHUTTING_DOWN = "shutting_down"
    LIMIT = "limit"
    UNAUTHORIZED = "unauthorized"
    WAVE_IN_USE = "wave_in_use"  # the wave is registered by another connection
    MOVED = "moved"  # the shard handed itself to its standby (it is stopping): go there
    NOT_PRIMARY = "not_primary"  # a standby whose primary is alive: it serves nobody yet
    INTERNAL = "internal"


def wave_name(worker: str, wave: int) -> str:
    """The one name of a wave in records, logs and stats: worker, slash, index (``w0/1``)."""
    return f"{worker}/{wave}"


class ProtocolError(Exception):
    """A request the shard refuses; becomes an ``error`` reply with this code and message."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ShardError(Exception):
    """Base of every failure a client sees when talking to a shard; catch this one."""


class ShardTimeout(ShardError, TimeoutError):
    """A shard did not take or answer a request in time (down, unreachable, wrong keys)."""

    def __init__(self, message: str, addresses: Sequence[str] = ()):
        super().__init__(message)
        self.addresses = list(addresses)


class ShardLost(ShardTimeout):
    """A shard's connection has been down past the job's ``shard_timeout_s`` and nothing took
    the shard over: the wave cannot go on without its part of the model."""


class RemoteError(ShardError):
    """An ``error`` reply: the shard refused the request with ``code``."""

    def __init__(self, code: str, message: str, address: str = ""):
        where = f" from {address}" if address else ""
        super().__init__(f"shard error{where}: [{code}] {message}")
        self.code = code
        self.message = message
        self.address = address


class BadReply(ShardError):
    """A reply this client cannot read (malformed, another protocol version): whatever answered
    does not speak this protocol."""


def decode_reply(frames: Sequence[Any], address: str = "") -> tuple[Header, list[torch.Tensor]]:
    """``decode`` on the client's side: a malformed reply is a ``BadReply``, one of the client's
    errors, never a ``ProtocolError`` (which is the shard's word for a refused request)."""
    try:
        return decode(frames)
    except ProtocolError as e:
        where = f" from {address}" if address else ""
        raise BadReply(f"unreadable reply{where}: {e}") from None


class NotRegistered(RemoteError):
    """The shard does not (or no longer) count this wave as a member; register again."""


def raise_for_error(header: Header, address: str = "") -> None:
    """Raise the client-side error an ``error`` reply stands for; nothing for other replies."""
    if header.op != Op.ERROR:
        return
    code = str(header.body.get("code", "?"))
    message = str(header.body.get("message", ""))
    cls = NotRegistered if code == ErrorCode.NOT_REGISTERED else RemoteError
    raise cls(code, message, address)


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire") from None


@dataclass(frozen=True)
class TensorDesc:
    """dtype and shape of one tensor frame."""

    dtype: str
    shape: tuple[int, ...]
    # worked out once: a message asks each descriptor several times (layout, checks)
    numel: int = field(init=False, compare=False, repr=False)
    nbytes: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", math.prod(self.shape))
        object.__setattr__(self, "nbytes", self.numel * _DTYPES[self.dtype].itemsize)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorDesc:
        return known_desc(dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


# A model's chunks repeat from message to message: each descriptor is made (and, received,
# checked) once and then looked up, about 1.5 us saved per tensor of every message
# (docs/performance.md). Only well-formed ones are kept, of a few dimensions, a bounded
# number, so a peer sending ever new shapes costs no more than before.
_KNOWN_DESCS: dict[tuple[str, tuple[int, ...]], TensorDesc] = {}
_KNOWN_MAX, _KNOWN_MAX_DIMS = 1 << 14, 8


def known_desc(dtype: str, shape: tuple[int, ...]) -> TensorDesc:
    """``TensorDesc(dtype, shape)`` (already checked), the same object each time it is asked."""
    key = (dtype, shape)
    desc = _KNOWN_DESCS.get(key)
    if desc is None:
        desc = TensorDesc(dtype, shape)
        if len(_KNOWN_DESCS) < _KNOWN_MAX and len(shape) <= _KNOWN_MAX_DIMS:
            _KNOWN_DESCS[key] = desc
    return desc


@dataclass
class Header:
    """Frame 0 of every message. ``body`` holds op-specific small fields (never tensors)."""

    op: str
    request_id: int = 0
    worker: str = ""
    wave: int = -1
    clock: int = -1
    read_version: int = -1  # the shard version the pushed gradient was computed from
    plan: str = ""  # sharding-plan fingerprint
    keys: list[int] = field(default_factory=list)
    tensors: list[TensorDesc] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)
    pack_below: int = 0  # tensors of fewer bytes are in the pack frame (encode sets it)
    version: int = PROTOCOL_VERSION

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "v": self.version,
                "op": str(self.op),
                "rid": self.request_id,
                "worker": self.worker,
                "wave": self.wave,
                "clock": self.clock,
                "read": self.read_version,
                "plan": self.plan,
                "keys": list(self.keys),
                "tensors": [[d.dtype, list(d.shape)] for d in self.tensors],
                "pack": self.pack_below,
                "body": self.body,
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Header:
        if len(raw) > MAX_HEADER_BYTES:
            raise ProtocolError(ErrorCode.MALFORMED, f"header of {len(raw)} bytes is too large")
        try:
            d = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise ProtocolError(ErrorCode.MALFORMED, f"header is not valid msgpack ({e})") from None
        if not isinstance(d, dict):
            raise ProtocolError(ErrorCode.MALFORMED, "header must be a msgpack map")
        version = d.get("v")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.BAD_PROTOCOL_VERSION,
                f"protocol version {version!r}, this shard speaks {PROTOCOL_VERSION}; "
                "run the same Wavelet release on workers and shards",
            )
        try:
            h = cls(
                op=_typed(d, "op", str),
                request_id=_typed(d, "rid", int),
                worker=_typed(d, "worker", str),
                wave=_typed(d, "wave", int),
                clock=_typed(d, "clock", int),
                read_version=_typed(d, "read", int),
                plan=_typed(d, "plan", str),
                keys=[check_type(k, int, "key") for k in _typed(d, "keys", list)],
                tensors=[_desc(t) for t in _typed(d, "tensors", list)],
                # absent: every tensor in a frame of its own
                pack_below=check_type(d.get("pack", 0), int, "header field 'pack'"),
                body=_typed(d, "body", dict),
            )
            if h.pack_below < 0:
                raise ValueError(f"header field 'pack' must be >= 0, got {h.pack_below}")
        except (TypeError, ValueError) as e:
            raise ProtocolError(ErrorCode.MALFORMED, str(e)) from None
        return h


def check_type(value: Any, kind: type, what: str) -> Any:
    # bool is an int subclass; a bool where a number belongs is a malformed message.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{what} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _typed(d: dict, name: str, kind: type) -> Any:
    if name not in d:
        raise ValueError(f"header field {name!r} is missing")
    return check_type(d[name], kind, f"header field {name!r}")


def _desc(t: Any) -> TensorDesc:
    if not (isinstance(t, list) and len(t) == 2 and isinstance(t[1], list)):
        raise TypeError("tensor descriptor must be [dtype, shape]")
    dtype, dims = t
    # one seen before (exact types: a bool or float where a dimension belongs equals an int)
    if type(dtype) is str and all(type(s) is int for s in dims):
        desc = _KNOWN_DESCS.get((dtype, tuple(dims)))
        if desc is not None:
            return desc
    dtype = check_type(dtype, str, "tensor dtype")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown tensor dtype {dtype!r}")
    shape = tuple(check_type(s, int, "tensor dimension") for s in dims)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative tensor dimension in {shape}")
    return known_desc(dtype, shape)


def tensor_frame(tensor: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes, ready for ``send(copy=False)``."""
    _check_framable(tensor)
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _check_framable(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu":
        raise ValueError("only CPU tensors can be framed; copy device tensors to host first")
    if not tensor.is_contiguous():
        raise ValueError("tensor frames must be contiguous")


def frame_tensor(buffer: Any, desc: TensorDesc) -> torch.Tensor:
    """Wrap a received frame as a tensor without copying; the frame must outlive the tensor."""
    view = memoryview(buffer)
    if view.nbytes != desc.nbytes:
        raise ProtocolError(
            ErrorCode.BAD_SHAPE,
            f"frame holds {view.nbytes} bytes, header says {desc.dtype}{list(desc.shape)} "
            f"({desc.nbytes} bytes)",
        )
    if desc.nbytes == 0:
        return torch.empty(desc.shape, dtype=desc.torch_dtype)
    return torch.frombuffer(view, dtype=desc.torch_dtype).reshape(desc.shape)


def encode(
    header: Header, tensors: Sequence[torch.Tensor] = (), pack_below: int = PACK_BELOW
) -> list[Any]:
    """Frames for one message: the header, the pack of the tensors under ``pack_below`` bytes
    (copied into it; absent when there are none), then each larger tensor's own zero-copy view.
    Fills in the header's tensor descriptors and ``pack_below``."""
    header.tensors = [TensorDesc.of(t) for t in tensors]
    header.pack_below = pack_below
    offsets, size = pack_layout(header.tensors, pack_below)
    frames: list[Any] = [header.pack()]
    if size is not None:
        frames.append(_packed(tensors, offsets))
    frames += [tensor_frame(t) for t, o in zip(tensors, offsets, strict=True) if o is None]
    return frames


def pack_layout(
    descs: Sequence[TensorDesc], pack_below: int
) -> tuple[list[int | None], int | None]:
    """Where each tensor starts in the pack (None: in a frame of its own), and the pack's size
    (None: no pack). Sender and receiver both derive it from the header alone."""
    offsets: list[int | None] = []
    end = None
    for d in descs:
        if d.nbytes < pack_below:
            start = 0 if end is None else -(-end // PACK_ALIGN) * PACK_ALIGN
            offsets.append(start)
            end = start + d.nbytes
        else:
            offsets.append(None)
    return offsets, end


def _packed(tensors: Sequence[torch.Tensor], offsets: list[int | None]) -> memoryview:
    """The pack: the small tensors' bytes in one fresh buffer (one copy, by one ``torch.cat``)."""
    pieces, end = [], 0
    for t, start in zip(tensors, offsets, strict=True):
        if start is None:
            continue
        _check_framable(t)
        if start > end:
            pieces.append(_PAD[: start - end])
        pieces.append(t.reshape(-1).view(torch.uint8))
        end = start + t.nbytes
    return memoryview(torch.cat(pieces).numpy())


def send_message(
    socket: zmq.Socket,
    header: Header,
    tensors: Sequence[torch.Tensor] = (),
    prefix: Sequence[bytes] = (),
    track: bool = False,
    flags_nonblocking: bool = False,
    pack_below: int = PACK_BELOW,
) -> zmq.MessageTracker | None:
    """Send one message, the larger tensors zero-copy. ``prefix`` carries ROUTER routing frames.

    With ``track=True`` the returned tracker is done once ZeroMQ no longer reads the message's
    memory (the pack's and the larger tensors'): a sender that will modify those tensors in place
    must wait for it first, and a message whose tracker is done has left.
    """
    header_frame, *payload = encode(header, tensors, pack_below)
    frames = [*prefix, header_frame]
    frames += [zmq.Frame(p, copy=False, track=track) for p in payload]
    socket.send_multipart(frames, flags=zmq.NOBLOCK if flags_nonblocking else 0, copy=False)
    if track and payload:
        return zmq.MessageTracker(*frames[len(prefix) + 1 :])
    return None


def decode(frames: Sequence[Any]) -> tuple[Header, list[torch.Tensor]]:
    """Header and zero-copy tensors from received frames (``zmq.Frame`` or bytes)."""
    if not frames:
        raise ProtocolError(ErrorCode.MALFORMED, "empty message")
    header = Header.unpack(_bytes_of(frames[0]))
    offsets, size = pack_layout(header.tensors, header.pack_below)
    payload = frames[1:]
    expected = offsets.count(None) + (size is not None)
    if len(payload) != expected:
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"header describes {len(header.tensors)} tensors in {expected} frames but "
            f"{len(payload)} frames followed",
        )
    singles = iter(payload)
    if size is not None:
        pack = memoryview(_buffer_of(next(singles))).cast("B")
        if pack.nbytes != size:
            raise ProtocolError(
                ErrorCode.BAD_SHAPE, f"the pack holds {pack.nbytes} bytes, header says {size}"
            )
    tensors = [
        frame_tensor(
            _buffer_of(next(singles)) if start is None else pack[start : start + d.nbytes], d
        )
        for d, start in zip(header.tensors, offsets, strict=True)
    ]
    return header, tensors


def error_header(request_id: int, code: ErrorCode | str, message: str) -> Header:
    return Header(op=Op.ERROR, request_id=request_id, body={"code": str(code), "message": message})


def _buffer_of(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def _bytes_of(frame: Any) -> bytes | memoryview:
    return frame.bytes if hasattr(frame, "bytes") else frame
