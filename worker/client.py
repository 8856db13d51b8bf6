"""PSClient: one wave's protocol with every parameter-server shard, and its recovery.

Each wave owns a DEALER socket per shard (ZeroMQ sockets are not thread-safe, and separate sockets
keep the two waves' traffic independent). A request goes to all shards before any reply is awaited,
and every wait has a deadline and notices a stop request. Tensors travel through the wave's data
path (worker/datapath.py: frames or shared memory); this module never touches their bytes.
Sending and gathering are ``Exchanges`` (worker/exchanges.py); following a shard that went away
is ``Recovery`` (worker/recovery.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch
import zmq

from wavelet.common.daemon_config import TRANSPORTS
from wavelet.common.messages import (
    AttachRequest,
    Body,
    InitRequest,
    PullRequest,
    RegisterRequest,
    reply_body,
)
from wavelet.common.protocol import (
    ErrorCode,
    Header,
    Op,
    RemoteError,
    ShardError,
    decode_reply,
)
from wavelet.common.security import ClientKeys
from wavelet.common.sharding import ShardingPlan
from wavelet.worker.datapath import WaveDataPath
from wavelet.worker.exchanges import Exchanges
from wavelet.worker.links import ShardLinks
from wavelet.worker.recovery import Recovery
from wavelet.worker.rounds import (
    PullResult,
    PushRound,
)

GOODBYE_S = 2.0  # how long a stopping wave waits for the shards to take its leave

log = logging.getLogger(__name__)


class PSClient(Recovery, Exchanges):
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
        keys: ClientKeys | None = None,
        transport: str = "auto",
        error_feedback: bool = False,
        part_bytes: int = 0,
        push_part_bytes: int = 0,
        lost_after_s: float = 10.0,
        on_move: Callable[[int, str], None] | None = None,
    ):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if len(addresses) != plan.num_shards:
            raise ValueError(f"{len(addresses)} addresses for a plan of {plan.num_shards} shards")
        self.plan = plan
        self.tensors = tensors
        self.worker = worker
        self.wave = wave
        self.timeout_s = timeout_s
        self.stop = stop or threading.Event()
        # weights after a push come in messages of about this many bytes (0: one per shard)
        self.part_bytes = part_bytes
        # a push over TCP during backward goes in parts of about this many bytes (0: whole)
        self.push_part_bytes = push_part_bytes
        self.chunks = [plan.for_shard(i) for i in range(plan.num_shards)]
        self._named: list[dict[str, list]] = [{} for _ in self.chunks]  # per shard, by tensor
        for named, chunks in zip(self._named, self.chunks, strict=True):
            for c in chunks:
                named.setdefault(c.name, []).append(c)
        self._ids = itertools.count(1)
        self.data = WaveDataPath(tensors, self.chunks, error_feedback)
        context = context or zmq.Context.instance()
        self.links = ShardLinks(context, addresses, keys, timeout_s, lost_after_s)
        self.on_move = on_move  # told where a shard went when its standby took it over
        self.last_versions = [0] * len(self.links)  # newest version seen from each shard
        self.lost_updates = 0
        self.lost_pushes = 0  # pushes a take-over lost, folded into a step that died (recovery)
        # when the wave's training budget ends (monotonic; None: no budget): a wait for the
        # shards past it ends the wave (BudgetSpent) instead of outliving --max-seconds
        self.budget_ends: float | None = None
        # what each push tells of its step: its batch's samples, the wave's last forward and
        # backward in seconds, and its seconds per step besides (a synchronous sum weighs by
        # the first, balancing uses all three)
        self.step_samples = 0
        self.step_compute_s = 0.0
        self.step_compute_samples = 0  # the batch step_compute_s measured
        # while this step's backward runs: its forward's seconds and when backward began
        # (perf_counter), so that a push leaving during backward tells this step's compute
        self.step_forward_s = 0.0
        self.backward_began: float | None = None
        self.step_overhead_s = 0.0
        self.transport = transport
        self.tcp_reasons: dict[str, str] = {}  # shard address -> why it is reached over TCP

    def measured_compute(self) -> tuple[float, int]:
        """The compute seconds a push tells the shards, and the batch they measured. A push
        that leaves during backward tells this step's so far (its forward and the backward up
        to the push, which leaves once the shard's gradients are all made: near the end for a
        shard that holds an early layer): telling the step before's instead, the shards saw a
        co-tenant's cap one step late, and every wave waited two slow steps, not one, for a
        node whose batch was still sized for full speed."""
        if self.backward_began is not None:
            so_far = self.step_forward_s + time.perf_counter() - self.backward_began
            return so_far, self.step_samples
        return self.step_compute_s, self.step_compute_samples

    @property
    def addresses(self) -> list[str]:
        """Where each shard is served now (a standby's address once it took a shard over)."""
        return self.links.addresses

    # --- operations ---------------------------------------------------------------------------

    def register(self, clock: int = 0, resume: bool = False) -> list[int]:
        """Join every shard's membership at ``clock`` (``resume``: at the clock the shard kept
        for us); seeds uninitialised shards with our weights. Returns each shard's clock for us."""
        replies = [
            reply_body(Op.REGISTER, h)
            for h, _ in self._while_in_use(
                lambda: self._all(Op.REGISTER, clock=clock, body=RegisterRequest(resume=resume))
            )
        ]
        for link, r in zip(self.links.links, replies, strict=True):
            link.standby = r.standby  # where to go if the shard is lost
        if resume:  # updates the shards applied before the stop that their checkpoints missed
            self.lost_updates += sum(r.lost_updates for r in replies)
        clocks = [r.clock for r in replies]
        if len(set(clocks)) > 1:
            # Shards placed us at different clocks (others pushed in between): take the newest
            # everywhere, or a pull would wait on this wave's own older clock forever.
            replies = [
                reply_body(Op.REGISTER, h)
                for h, _ in self._all(
                    Op.REGISTER, clock=max(clocks), body=RegisterRequest(exact=True)
                )
            ]
            clocks = [r.clock for r in replies]
        self.init()
        for i in range(len(self.links)):
            self._attach(i)
        return clocks

    @property
    def transports(self) -> list[str]:
        """How tensors travel to and from each shard: shm or tcp."""
        return self.data.transports

    def init(self) -> None:
        messages = [self._init_message(i) for i in range(len(self.chunks))]
        self.data.flush()
        self._exchange(messages)

    def _init_message(self, shard: int) -> tuple[Header, list[torch.Tensor]]:
        """Our current weights for one shard's chunks: they seed it if it holds none."""
        chunks = self.chunks[shard]
        h = self._header(
            Op.INIT,
            keys=[c.key for c in chunks],
            body=InitRequest(
                trainable=[c.trainable for c in chunks],
                wire=[c.wire for c in chunks],
                ndims=[self.data.tensors[c.name].dim() for c in chunks],
                version=self.last_versions[shard],  # what our weights carry (0 at the start)
            ),
        )
        return h, self.data.weights(shard)

    def pull(self, clock: int, observer: bool = False, master: bool = False) -> PullResult:
        """Read every shard's weights into our tensors (may wait for the staleness bound);
        ``observer`` never waits, and with ``master`` reads the fp32 master weights."""
        messages = [
            (
                self._header(
                    Op.PULL,
                    clock=clock,
                    body=PullRequest(observer=True, master=master)
                    if observer
                    else PullRequest(shm=shm),
                ),
                [],
            )
            for shm in map(self.data.shm, range(len(self.links)))
        ]
        recover = None if observer else (lambda i: self._recover(i, clock))
        return self._exchange(messages, recover, pull=True).pull.result()

    def push_pull(
        self, clock: int, read_versions: list[int], lr_scale: float = 1.0, skip: bool = False
    ) -> PullResult:
        """Push our gradients (and buffers) for ``clock``, then read weights for ``clock + 1``.

        ``lr_scale`` multiplies the learning rate of this update (the job's schedule). ``skip``:
        this step has no gradients to give (fp16 overflow); the shards let the clock pass."""
        return self.start_push(clock, read_versions, lr_scale).finish(skip)

    def start_push(self, clock: int, read_versions: list[int], lr_scale: float = 1.0) -> PushRound:
        """A push_pull whose message to each shard may go out on its own, as soon as that
        shard's gradients are ready (``PushRound.send``, during backward); ``finish`` sends the
        rest and waits for every reply."""
        return PushRound(self, clock, read_versions, lr_scale)

    def chunks_named(self, shard: int, name: str) -> list:
        """Shard ``shard``'s chunks of tensor ``name``."""
        return self._named[shard].get(name, [])

    @property
    def round_trip_bytes(self) -> int:
        """Tensor bytes one push_pull puts on the wire (TCP): every chunk up and back, except
        those of shards reached through shared memory."""
        return self.data.round_trip_bytes

    def leave(self) -> None:
        try:
            self._all(Op.LEAVE)
        except RemoteError as e:
            # a shard that restarted or dropped us, or that handed itself to its standby (where
            # the standby's lease ends us): there is nothing to leave
            if e.code not in (ErrorCode.NOT_REGISTERED, ErrorCode.MOVED):
                raise

    def stats(self) -> list[dict]:
        return [h.body for h, _ in self._all(Op.STATS)]

    def goodbye(self, timeout_s: float = GOODBYE_S) -> None:
        """Leave every shard that answers within ``timeout_s``, whatever else happens (a stop,
        a shard that is gone): a wave that stops says so, and nobody waits for its lease."""
        rid = next(self._ids)
        waiting = set()
        for i in range(len(self.links)):
            h = self._header(Op.LEAVE)
            h.request_id = rid
            if self.links[i].down_since is None and self._try_send(i, h, []):
                waiting.add(i)
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            for sock, _ in self.links.poller.poll(50):
                monitor, i = self.links.which(sock)
                if i < 0:
                    continue
                if monitor:
                    self.links.take_event(i)
                    continue
                try:
                    h, _ = decode_reply(sock.recv_multipart(zmq.NOBLOCK, copy=False))
                except (zmq.Again, ShardError):
                    continue
                if h.request_id == rid:
                    waiting.discard(i)

    def close(self) -> None:
        self.data.close()
        self.links.close()

    # --- shared memory ------------------------------------------------------------------------

    def _attach(self, i: int) -> None:
        """Ask shard ``i`` for shared-memory segments and use them if we can open them (same
        host, same user); otherwise tell it so and stay on TCP (--transport shm: fail)."""
        if self.transport == "tcp":
            return
        self.data.use_tcp(i)
        self.tcp_reasons.pop(self.addresses[i], None)
        ask = AttachRequest(transport="shm", **self.data.memory_offer(i))
        offer = reply_body(Op.ATTACH, self._request_one(i, self._header(Op.ATTACH, body=ask)))
        if offer.memory_reason:
            log.info("shard %s copies weights for us: %s", self.addresses[i], offer.memory_reason)
        if offer.transport == "shm":
            try:
                self.data.use_shm(i, offer)
                return
            except OSError as e:
                reason = f"cannot open its shared-memory segments ({e})"
            self._request_one(i, self._header(Op.ATTACH, body=AttachRequest(transport="tcp")))
        else:
            reason = offer.reason or "it offers no shared memory"
        if self.transport == "shm":
            raise ShardError(
                f"--transport shm, but shard {self.addresses[i]}: {reason}; use --transport auto "
                "to fall back to TCP"
            )
        self.tcp_reasons[self.addresses[i]] = reason
        log.info(
            "wave %s/%d talks to shard %s over TCP: %s",
            self.worker,
            self.wave,
            self.addresses[i],
            reason,
        )

    # --- requests -----------------------------------------------------------------------------

    def _header(self, op: Op, body: Body | None = None, **fields) -> Header:
        """A request of this wave; ``body`` is the op's typed request body (common/protocol)."""
        return Header(
            op=op,
            worker=self.worker,
            wave=self.wave,
            plan=self.plan.fingerprint,
            body=body.to_wire() if body is not None else {},
            **fields,
        )

    def _all(self, op: Op, **fields) -> list[tuple[Header, list[torch.Tensor]]]:
        return self._exchange([(self._header(op, **fields), []) for _ in self.links.links]).replies
