"""One request round of a wave with every shard: its messages and the replies gathered so far.

``PSClient`` (``worker/client.py``) sends and gathers; this module keeps what one round holds:
the replies (``Exchange``), a pull's weights loaded part by part as they arrive
(``PullParts``), a pull still on its way that the next forward takes layer by layer
(``PendingPull``), and a push sent shard by shard during backward (``PushRound``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from wavelet.common.messages import PushRequest, WeightsReply, reply_body
from wavelet.common.protocol import Header, Op, ShardError
from wavelet.common.sharding import Chunk


class StopRequested(Exception):
    """The daemon is shutting down; the wave should stop where it is."""


class BudgetSpent(Exception):
    """The wave's training budget (``max_seconds``) ended while it waited for the shards."""


@dataclass
class PullResult:
    versions: list[int]  # the version each shard's weights carry
    parked_s: float  # longest time a shard held the pull back for the staleness bound
    dropped: int = 0  # shards that dropped the gradient pushed with this pull (drop policy)
    slowest_clock: list[int] = field(default_factory=list)  # per shard, when it served the read
    batch: int = 0  # the batch the shards ask the wave to take next (0: unchanged)


@dataclass
class Exchange:
    """One request id's messages to the shards and the replies gathered so far."""

    request_id: int
    replies: list
    unsent: dict[int, tuple[Header, list[torch.Tensor]]] = field(default_factory=dict)
    pull: PullParts | None = None  # a pull's replies: weights, taken in part by part

    def take(self, i: int, reply: tuple[Header, list[torch.Tensor]]) -> None:
        """A reply (or one part of it) from shard ``i``."""
        if self.pull is None or self.pull.take(i, *reply):
            self.replies[i] = reply

    def take_rejoin(self, i: int, reply: tuple[Header, list[torch.Tensor]]) -> None:
        """The pull of a re-join with shard ``i``: it stands in for all of shard i's reply."""
        if self.pull is not None:
            self.pull.restart(i)
        self.take(i, reply)


class PullParts:
    """A pull's weights, loaded into the wave's tensors as each shard's reply, or each part of
    it, arrives; ``loaded`` holds the chunk keys in so far (worker/pull_hooks.py waits on it)."""

    def __init__(self, client):
        self.client = client
        shards = len(client.links)
        self.bodies: list[WeightsReply | None] = [None] * shards
        self.next_part = [0] * shards
        self.next_chunk = [0] * shards
        self.loaded: set[int] = set()
        self._result: PullResult | None = None

    def take(self, i: int, h: Header, tensors: list[torch.Tensor]) -> bool:
        """Load one part of shard ``i``'s weights; True once all of its reply is in."""
        address = self.client.addresses[i]
        body = reply_body(Op.PULL, h)
        first = self.bodies[i]
        if body.part != self.next_part[i] or (first is not None and body.parts != first.parts):
            raise ShardError(
                f"shard {address} sent part {body.part} of {body.parts} where part "
                f"{self.next_part[i]} was due"
            )
        if first is None:
            self.bodies[i] = body
        try:
            keys = self.client.data.load(
                i, body.shm, h.keys, tensors, self.next_chunk[i], body.slot, body.in_wave_memory
            )
        except ValueError as e:
            raise ShardError(f"shard {address} {e}") from None
        self.loaded.update(keys)
        self.next_chunk[i] += len(keys)
        self.next_part[i] += 1
        if self.next_part[i] < body.parts:
            return False
        held = len(self.client.chunks[i])
        if self.next_chunk[i] != held:
            raise ShardError(f"shard {address} sent {self.next_chunk[i]} of its {held} chunks")
        return True

    def restart(self, i: int) -> None:
        """Shard ``i`` answers afresh (a re-join): forget the parts it sent before."""
        self.bodies[i] = None
        self.next_part[i] = self.next_chunk[i] = 0

    def result(self) -> PullResult:
        """What the whole pull read (every shard's reply is in)."""
        if self._result is None:
            bodies = self.bodies
            versions = [b.version for b in bodies]
            client = self.client
            client.last_versions = [
                max(a, b) for a, b in zip(client.last_versions, versions, strict=True)
            ]
            self._result = PullResult(
                versions=versions,
                parked_s=max(b.parked_s for b in bodies),
                dropped=sum(b.action == "dropped" for b in bodies),
                slowest_clock=[b.slowest_clock for b in bodies],
                batch=bodies[0].batch,  # one shard decides, so that every reply agrees
            )
        return self._result


class PendingPull:
    """The weights of a push_pull still on their way (``PushRound.finish(defer=True)``): the
    wave's next forward waits only for the chunks each layer needs (``wait_for``, from
    worker/pull_hooks.py) and ``result`` for the rest. Its sockets are used by whichever thread
    calls, one at a time: the wave's, or the computing thread while the wave's waits on it."""

    def __init__(self, client, exchange: Exchange, recover):
        self.client, self.exchange, self.recover = client, exchange, recover
        self.waited_s = 0.0  # spent waiting for weights, in wait_for and result

    @property
    def loaded(self) -> set[int]:
        return self.exchange.pull.loaded

    def wait_for(self, keys: frozenset[int]) -> None:
        """Return once every chunk in ``keys`` is loaded."""
        loaded = self.loaded
        if keys <= loaded:
            return
        began = time.perf_counter()
        self.client._gather(self.exchange, self.recover, until=lambda: keys <= loaded)
        self.waited_s += time.perf_counter() - began

    def take_arrived(self) -> None:
        """Take in what has arrived, without waiting: parts of the weights, or a shard's word
        that it moved (the push is then given again to its standby). Called while the wave
        waits for the baton: the other wave, baton in hand, may be waiting for the update
        this wave's push makes, which a moved shard's refusal left unmade until read."""
        if any(r is None for r in self.exchange.replies):
            self.client._gather(self.exchange, self.recover, once=True)

    def result(self) -> PullResult:
        """Every shard's weights loaded; what the pull read."""
        if any(r is None for r in self.exchange.replies):
            began = time.perf_counter()
            self.client._gather(self.exchange, self.recover)
            self.waited_s += time.perf_counter() - began
        return self.exchange.pull.result()


class PushRound:
    """One push_pull, sent shard by shard: ``send(shard)`` as soon as backward has made that
    shard's gradients (worker/push_hooks.py calls it from a gradient hook, while backward goes
    on), ``finish()`` for the rest and every reply. Each shard still gets one whole push: a
    version means one push, as before."""

    def __init__(self, client, clock: int, read_versions: list[int], lr_scale: float):
        self.client, self.clock = client, clock
        self.read_versions, self.lr_scale = read_versions, lr_scale
        self.exchange = client._open_exchange(pull=True)
        self.sent = [False] * len(client.links)
        self.first_sent_at: float | None = None  # time.perf_counter() of the first send
        shards = len(client.links)
        self.parted: list[set[int]] = [set() for _ in range(shards)]  # keys gone in parts
        self.ready: list[list] = [[] for _ in range(shards)]  # chunks made, not yet sent

    @property
    def early(self) -> int:
        """Shards whose push went out before ``finish``."""
        return sum(self.sent)

    def send(self, shard: int) -> None:
        """Push to ``shard`` now; a shard that restarted waits for ``finish`` (re-joining it is
        a request of its own, not for the middle of backward)."""
        c = self.client
        if self.sent[shard] or c.links[shard].restarted:
            return
        self.sent[shard] = True
        if self.first_sent_at is None:
            self.first_sent_at = time.perf_counter()
        h, tensors = push_message(
            c,
            shard,
            self.clock,
            self.read_versions[shard],
            self.lr_scale,
            False,
            frozenset(self.parted[shard]),
        )
        c.data.flush()
        c._send_in(self.exchange, shard, h, tensors, None)

    def part(self, shard: int, name: str) -> None:
        """Backward made parameter ``name``'s gradient: over TCP, once ``push_part_bytes`` of
        ``shard``'s chunks are made, they go ahead as a part of its push (ps/push_parts.py),
        to cross the link while backward goes on. A part that cannot be queued now goes with
        the last one."""
        c = self.client
        if not c.push_part_bytes or self.sent[shard] or c.data.shm(shard):
            return
        if c.links[shard].restarted:
            return
        self.ready[shard] += c.chunks_named(shard, name)  # each parameter's hook runs once
        if sum(ch.wire_nbytes for ch in self.ready[shard]) < c.push_part_bytes:
            return
        chunks, self.ready[shard] = self.ready[shard], []
        h, tensors = push_part_message(c, self.clock, self.read_versions[shard], chunks)
        c.data.flush()
        h.request_id = self.exchange.request_id
        if c._try_send(shard, h, tensors):
            self.parted[shard].update(ch.key for ch in chunks)
            if self.first_sent_at is None:
                self.first_sent_at = time.perf_counter()

    def finish(self, skip: bool = False, defer: bool = False) -> PullResult | PendingPull:
        """Push to every shard not pushed yet (``skip``: with no gradients, the fp16 overflow
        case, which never pushes early) and read every shard's next weights; with ``defer``,
        return at once and let the next forward take them as they come (``PendingPull``)."""
        c = self.client
        if skip and any(self.sent):
            raise RuntimeError("a skipped step cannot have pushed gradients during backward")
        late = [i for i, sent in enumerate(self.sent) if not sent]

        def recover(i: int):
            # a standby that lacks this push (its primary died with it) is given it again
            def again():
                return push_message(
                    c,
                    i,
                    self.clock,
                    self.read_versions[i],
                    self.lr_scale,
                    skip and not self.sent[i],
                    whole_reply=True,  # read as one message (Recovery._recover)
                )

            return c._recover(i, self.clock + 1, repush=again)

        for i in late:
            # each shard's push goes out as soon as its gradients are in place: the first
            # shard updates while the next one's are copied (into its shared-memory segment)
            h, tensors = push_message(
                c,
                i,
                self.clock,
                self.read_versions[i],
                self.lr_scale,
                skip,
                frozenset(self.parted[i]),
            )
            c.data.flush()
            c._send_in(self.exchange, i, h, tensors, recover)
        pending = PendingPull(c, self.exchange, recover)
        return pending if defer else pending.result()


def push_part_message(
    client, clock: int, read_version: int, chunks: list[Chunk]
) -> tuple[Header, list[torch.Tensor]]:
    """One part of a push over TCP (``PushRequest.more``): ``chunks``' gradients."""
    keys = [chunk.key for chunk in chunks]
    body = PushRequest(more=True)
    h = client._header(Op.PUSH_PULL, clock=clock, read_version=read_version, keys=keys, body=body)
    return h, client.data.frames(chunks)


def push_message(
    client,
    shard: int,
    clock: int,
    read_version: int,
    lr_scale: float,
    skip: bool,
    sent: frozenset[int] = frozenset(),
    whole_reply: bool = False,
) -> tuple[Header, list[torch.Tensor]]:
    """Shard ``shard``'s push for ``clock``: its header, and its frames (none when the
    gradients went into its shared-memory segment, or for a skipped step); ``sent``: keys of
    chunks that went ahead in parts (``push_part_message``), which its last part leaves out;
    ``whole_reply``: the weights come back in one message, even where the wave pulls in parts."""
    data = client.data
    compute_s, compute_samples = client.measured_compute()
    body = PushRequest(
        lr_scale=lr_scale,
        shm=data.shm(shard) and not skip,
        skip=skip,
        part_bytes=0 if whole_reply else client.part_bytes,
        absent=[] if skip else data.without_gradient(shard),
        samples=client.step_samples,
        compute_s=compute_s,
        compute_samples=compute_samples,
        overhead_s=client.step_overhead_s,
    )
    chunks = [] if skip else [c for c in client.chunks[shard] if c.key not in sent]
    keys = [chunk.key for chunk in chunks]
    h = client._header(Op.PUSH_PULL, clock=clock, read_version=read_version, keys=keys, body=body)
    if skip:
        return h, []
    return h, data.frames(chunks) if sent else data.gradients(shard)
