"""PSClient: one wave's connection to every parameter-server shard.

Each wave owns a DEALER socket per shard (ZeroMQ sockets are not thread-safe, and separate sockets
keep the two waves' traffic independent). A request goes to all shards before any reply is awaited,
and every wait has a deadline and notices a stop request.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from wavelet.common.protocol import Header, Op, RemoteError, decode, send_message
from wavelet.common.sharding import Chunk, ShardingPlan, chunk_view


class StopRequested(Exception):
    """The daemon is shutting down; the wave should stop where it is."""


class ShardTimeout(TimeoutError):
    pass


@dataclass
class PullResult:
    versions: list[int]  # the version each shard's weights carry
    parked_s: float  # longest time a shard held the pull back for the staleness bound
    dropped: int = 0  # shards that dropped the gradient pushed with this pull (drop policy)
    slowest_clock: list[int] = field(default_factory=list)  # per shard, when it served the read


class PSClient:
    """Talks to all shards for one wave (``worker``, ``wave``) about one model's tensors."""

    def __init__(
        self,
        addresses: list[str],
        plan: ShardingPlan,
        tensors: dict[str, torch.Tensor],
        worker: str,
        wave: int,
        timeout_s: float = 300.0,
        stop: threading.Event | None = None,
        context: zmq.Context | None = None,
    ):
        if len(addresses) != plan.num_shards:
            raise ValueError(f"{len(addresses)} addresses for a plan of {plan.num_shards} shards")
        self.addresses = addresses
        self.plan = plan
        self.tensors = tensors
        self.worker = worker
        self.wave = wave
        self.timeout_s = timeout_s
        self.stop = stop or threading.Event()
        self.chunks = [plan.for_shard(i) for i in range(plan.num_shards)]
        self._ids = itertools.count(1)
        self._staging: dict[int, torch.Tensor] = {}
        context = context or zmq.Context.instance()
        self.sockets = []
        for a in addresses:
            s = context.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a)
            self.sockets.append(s)
        self.poller = zmq.Poller()
        for s in self.sockets:
            self.poller.register(s, zmq.POLLIN)

    # --- operations ---------------------------------------------------------------------------

    def register(self, clock: int = 0) -> list[int]:
        """Join every shard's membership at ``clock``; seeds uninitialised shards with our weights.

        Returns the clock each shard recorded."""
        replies = self._all(Op.REGISTER, clock=clock)
        self.init()
        return [h.body["clock"] for h, _ in replies]

    def init(self) -> None:
        messages = []
        for chunks in self.chunks:
            h = self._header(
                Op.INIT,
                keys=[c.key for c in chunks],
                body={"trainable": [c.trainable for c in chunks]},
            )
            messages.append((h, [self._host(self.tensors[c.name], c) for c in chunks]))
        self._exchange(messages)

    def pull(self, clock: int, observer: bool = False) -> PullResult:
        """Read every shard's weights into our tensors (may wait for the staleness bound)."""
        replies = self._all(Op.PULL, clock=clock, body={"observer": True} if observer else {})
        return self._load(replies)

    def push_pull(self, clock: int, read_versions: list[int], lr_scale: float = 1.0) -> PullResult:
        """Push our gradients (and buffers) for ``clock``, then read weights for ``clock + 1``.

        ``lr_scale`` multiplies the learning rate of this update (the job's schedule)."""
        messages = []
        for shard, chunks in enumerate(self.chunks):
            h = self._header(
                Op.PUSH_PULL,
                clock=clock,
                read_version=read_versions[shard],
                keys=[c.key for c in chunks],
                body={"lr_scale": lr_scale},
            )
            messages.append((h, [self._push_tensor(c) for c in chunks]))
        return self._load(self._exchange(messages))

    @property
    def round_trip_bytes(self) -> int:
        """Tensor bytes one push_pull puts on the wire: every chunk up, every chunk back."""
        return 2 * sum(c.nbytes for c in self.plan.chunks)

    def leave(self) -> None:
        self._all(Op.LEAVE)

    def stats(self) -> list[dict]:
        return [h.body for h, _ in self._all(Op.STATS)]

    def close(self) -> None:
        for s in self.sockets:
            s.close(linger=0)

    # --- moving tensors -----------------------------------------------------------------------

    def _push_tensor(self, chunk: Chunk) -> torch.Tensor:
        t = self.tensors[chunk.name]
        if chunk.trainable:
            if t.grad is None:  # a parameter this batch did not touch
                return torch.zeros(chunk.numel, dtype=t.dtype)
            t = t.grad
        return self._host(t, chunk)

    def _host(self, tensor: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """The chunk's slice on the host: a view on CPU, a pinned staging copy from a GPU."""
        view = chunk_view(tensor.detach(), chunk)
        if view.device.type == "cpu":
            return view
        staged = self._staging.get(chunk.key)
        if staged is None:
            staged = torch.empty(chunk.numel, dtype=view.dtype, pin_memory=True)
            self._staging[chunk.key] = staged
        staged.copy_(view, non_blocking=True)
        torch.cuda.current_stream(view.device).synchronize()
        return staged

    def _load(self, replies: list[tuple[Header, list[torch.Tensor]]]) -> PullResult:
        with torch.no_grad():
            for chunks, (_, tensors) in zip(self.chunks, replies, strict=True):
                for c, value in zip(chunks, tensors, strict=True):
                    chunk_view(self.tensors[c.name].data, c).copy_(value)
        return PullResult(
            versions=[h.body["version"] for h, _ in replies],
            parked_s=max(h.body.get("parked_s", 0.0) for h, _ in replies),
            dropped=sum(h.body.get("action") == "dropped" for h, _ in replies),
            slowest_clock=[h.body.get("slowest_clock", -1) for h, _ in replies],
        )

    # --- requests -----------------------------------------------------------------------------

    def _header(self, op: Op, **fields) -> Header:
        return Header(
            op=op, worker=self.worker, wave=self.wave, plan=self.plan.fingerprint, **fields
        )

    def _all(self, op: Op, **fields) -> list[tuple[Header, list[torch.Tensor]]]:
        return self._exchange([(self._header(op, **fields), []) for _ in self.sockets])

    def _exchange(
        self, messages: list[tuple[Header, list[torch.Tensor]]]
    ) -> list[tuple[Header, list[torch.Tensor]]]:
        """Send message i to shard i, then gather every reply (or raise on the first error)."""
        rid = next(self._ids)
        for sock, (h, tensors) in zip(self.sockets, messages, strict=True):
            h.request_id = rid
            send_message(sock, h, tensors)
        replies: list = [None] * len(self.sockets)
        index = {s: i for i, s in enumerate(self.sockets)}
        deadline = time.monotonic() + self.timeout_s
        while any(r is None for r in replies):
            if self.stop.is_set():
                raise StopRequested()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [self.addresses[i] for i, r in enumerate(replies) if r is None]
                raise ShardTimeout(
                    f"no reply within {self.timeout_s:.0f}s from shard(s) {', '.join(missing)}; "
                    "check that `wavelet ps` runs there and the address is right"
                )
            for sock, _ in self.poller.poll(min(left, 0.2) * 1000):
                h, tensors = decode(sock.recv_multipart(copy=False))
                if h.request_id != rid:
                    continue  # a late answer to a request we already gave up on
                i = index[sock]
                if h.op == Op.ERROR:
                    raise RemoteError(
                        h.body.get("code", "?"), h.body.get("message", ""), self.addresses[i]
                    )
                replies[i] = (h, tensors)
        return replies


def call_shard(
    address: str, op: Op, timeout_s: float = 5.0, context: zmq.Context | None = None, **fields
) -> Header:
    """One request to one shard outside any wave (stats, shutdown, checkpoint); raises on error."""
    context = context or zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        send_message(sock, Header(op=op, request_id=1, **fields))
        if not sock.poll(timeout_s * 1000):
            raise ShardTimeout(f"shard {address} did not answer {op} within {timeout_s:.0f}s")
        h, _ = decode(sock.recv_multipart(copy=False))
        if h.op == Op.ERROR:
            raise RemoteError(h.body.get("code", "?"), h.body.get("message", ""), address)
        return h
    finally:
        sock.close(linger=0)
