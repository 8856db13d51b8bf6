"""Endpoint: one ROUTER socket and the shard service behind it, with its send tracking.

A shard daemon has one endpoint for its own shard and, where it hosts another shard's standby,
one for that (``ps/server.py`` runs both in one loop). Weight replies go out zero-copy, so the
endpoint tracks which sends ZeroMQ still reads: while any does, the service moves the parameters
to fresh memory before an update (nothing waits on a slow reader, and no reply mixes two
versions), and a client with ``MAX_UNREAD_REPLIES`` weight replies still unsent gets an error
instead of another one, which bounds the memory a reader that never reads can pin.

With ``shard_replicas = 2`` the endpoint also holds replies back until the standby acknowledged
every update they could show (``ps/replication.py``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from wavelet.common.protocol import ErrorCode, error_header, send_message
from wavelet.ps.datapath import Outgoing
from wavelet.ps.owners import Peer

log = logging.getLogger(__name__)

MAX_UNREAD_REPLIES = 4  # weight replies per client that ZeroMQ may still be sending
# longest wait for pyzmq to report a delivered reply before refusing: 20 ms still refused an
# honest TCP wave of a test when two test workers loaded both cores (CI, 2026-12-05)
GC_GRACE_S = 0.2
GC_GRACE_PER_TURN_S = 0.2  # all such waits in one loop turn together, however many non-readers


class BindError(RuntimeError):
    """The shard could not listen on its address (in use, not this host's, bad interface)."""


class Endpoint:
    def __init__(
        self,
        context: zmq.Context,
        bind: str,
        max_message_mib: float,
        lost_after_s: float,
        security=None,
    ):
        self._sending: dict[bytes, list[zmq.MessageTracker]] = defaultdict(list)
        self._grace_left = GC_GRACE_PER_TURN_S
        self._refused: set[bytes] = set()  # peers refused for unread replies, until they read
        self._peer_fd: dict[bytes, int] = {}  # connection of each peer, to notice it close
        self._held: deque[list[Outgoing]] = deque()  # answers waiting for the standby
        self.bytes_in = 0  # over ZeroMQ (shared-memory tensors are not counted here)
        self.bytes_out = 0
        self.service = None  # ShardService, set once built (it needs _weights_in_flight)
        self.in_step: Callable[[], bool] = lambda: True  # the standby has what replies show
        self.security = security
        self.socket = context.socket(zmq.ROUTER)
        if security:
            security.apply(self.socket)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A peer that reconnects under the identity it had (a primary's link to its standby,
        # after its process was stopped) takes that identity over. Without it, a reconnection
        # that came before the old connection was seen to close was refused: its messages were
        # dropped while ZMTP heartbeats kept it looking alive, and a mirroring primary held
        # every reply for an acknowledgement that never came.
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.socket.setsockopt(zmq.MAXMSGSIZE, int(max_message_mib * (1 << 20)))
        # ZMTP pings: a peer whose host vanished is disconnected, like one that closed
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(lost_after_s * 1000))
        try:
            self.socket.bind(bind)
        except zmq.ZMQError as e:
            self.socket.close(linger=0)
            raise BindError(
                f"cannot listen on {bind}: {e.strerror}; pick another port "
                "(port 0 picks a free one) or stop what uses it"
            ) from None
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        # Closed connections release the waves they registered (ps/owners.py).
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def serve_one(self) -> bool:
        """Receive and answer one request, if one is queued; False when none was."""
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        self.bytes_in += sum(len(f) for f in frames[1:])
        # a connection that closed before this message came is forgotten first, so that a
        # new one on a reused descriptor is not taken for it
        self.connections_closed()
        peer = self._peer(frames)
        self.send_all(self.service.handle(peer, frames[1:]))
        return True

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=500)

    # --- connections --------------------------------------------------------------------------

    def _peer(self, frames: list[zmq.Frame]) -> Peer:
        """Who sent ``frames``: the ROUTER identity and, with CURVE, the authenticated key."""
        identity = frames[0].bytes
        last = frames[-1]
        try:
            self._peer_fd[identity] = last.get(zmq.SRCFD)
        except zmq.ZMQError:
            pass  # inproc: no descriptor, and no other process
        key = ""
        if self.security:
            try:
                key = last.get("User-Id")
            except zmq.ZMQError:
                key = ""
        return Peer(identity, key)

    def connections_closed(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            fd = int(event["value"])
            for identity in [i for i, f in self._peer_fd.items() if f == fd]:
                del self._peer_fd[identity]
                self._sending.pop(identity, None)
                self._refused.discard(identity)
                self.send_all(self.service.connection_closed(identity))

    # --- sending ------------------------------------------------------------------------------

    def new_turn(self) -> None:
        self._grace_left = GC_GRACE_PER_TURN_S

    def send_all(self, messages: list[Outgoing]) -> None:
        answers = _answers(messages)
        if self._held or not self.in_step():
            self._held.extend(answers)  # in order, behind what waits already
            return
        for answer in answers:
            self._send(answer)

    def release_held(self) -> None:
        """Send what waited for the standby, once it has every version those replies show."""
        while self._held and self.in_step():
            self._send(self._held.popleft())

    def refuse_held(self, code: ErrorCode, message: str) -> None:
        """Answer every reply still waiting for the standby with an error instead (the shard
        is not this process's any more: what those replies show must not reach a wave)."""
        while self._held:
            m = self._held.popleft()[0]
            send_message(
                self.socket, error_header(m.header.request_id, code, message), prefix=[m.peer]
            )

    def _send(self, answer: list[Outgoing]) -> None:
        """One answer: a message, or the parts of one weights reply, counted as one reply."""
        m = answer[0]
        for part in answer:
            self.bytes_out += sum(t.nbytes for t in part.tensors) + 64  # tensors, a header
        if not m.carries_weights:
            send_message(self.socket, m.header, m.tensors, prefix=[m.peer])
            return
        unread = [t for t in self._sending[m.peer] if not t.done]
        if len(unread) >= MAX_UNREAD_REPLIES:
            # A tracker turns done only once pyzmq's garbage-collector thread has run, which this
            # loop (holding the GIL) can delay: give it a moment before calling a client a
            # non-reader, or an honest client with replies long delivered would be refused.
            # A peer already refused gets no grace again until it reads, and all such waits in
            # one loop turn share one budget: several non-readers must not slow everyone else.
            grace = 0.0 if m.peer in self._refused else min(GC_GRACE_S, self._grace_left)
            if grace > 0:
                waited = time.monotonic()
                try:
                    unread[0].wait(grace)
                except zmq.NotDone:
                    pass
                self._grace_left -= time.monotonic() - waited
            unread = [t for t in unread if not t.done]
        self._sending[m.peer] = unread
        if len(unread) < MAX_UNREAD_REPLIES:
            self._refused.discard(m.peer)
        else:
            message = (
                f"{len(unread)} earlier replies to this client are still unsent (it does not "
                "read them); read replies before sending more requests"
            )
            if m.peer not in self._refused:  # once per client until it reads: no log flood
                log.warning("refused a read: %s", message)
            self._refused.add(m.peer)
            self.service.count_refusal(ErrorCode.LIMIT)
            send_message(
                self.socket,
                error_header(m.header.request_id, ErrorCode.LIMIT, message),
                prefix=[m.peer],
            )
            return
        trackers = [
            send_message(self.socket, p.header, p.tensors, prefix=[p.peer], track=True)
            for p in answer
        ]
        unread.append(trackers[0] if len(trackers) == 1 else zmq.MessageTracker(*trackers))

    def weights_in_flight(self) -> bool:
        """Whether ZeroMQ still reads any weight reply's memory (pruning finished sends)."""
        busy = any(a[0].carries_weights for a in self._held)  # zero-copy, not sent yet
        for peer in list(self._sending):
            left = [t for t in self._sending[peer] if not t.done]
            if left:
                self._sending[peer] = left
                busy = True
            else:
                del self._sending[peer]
        return busy


def _answers(messages: list[Outgoing]) -> list[list[Outgoing]]:
    """``messages`` grouped into answers: the parts of one weights reply (same peer, same
    request, one after another) together, every other message alone."""
    answers: list[list[Outgoing]] = []
    for m in messages:
        last = answers[-1][-1] if answers else None
        if (
            last is not None
            and m.carries_weights
            and last.carries_weights
            and (m.peer, m.header.request_id) == (last.peer, last.header.request_id)
        ):
            answers[-1].append(m)
        else:
            answers.append([m])
    return answers
