"""ShardServer: the transport of one shard: its ROUTER socket, the loop, and send tracking.

Everything about what a request means lives in ``ShardService`` (``ps/service.py``); this file
receives frames, hands them over, and sends what comes back. Weight replies go out zero-copy, so
the server tracks which sends ZeroMQ still reads: while any does, the service moves the
parameters to fresh memory before an update (nothing waits on a slow reader, and no reply mixes
two versions), and a client with ``MAX_UNREAD_REPLIES`` weight replies still unsent gets an error
instead of another one, which bounds the memory a reader that never reads can pin.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from wavelet.common.daemon_config import PSConfig
from wavelet.common.protocol import ErrorCode, error_header, send_message
from wavelet.common.security import (
    ServerSecurity,
    check_bind,
    load_admin_token,
    public_key_z85,
)
from wavelet.ps.datapath import Outgoing
from wavelet.ps.owners import Peer
from wavelet.ps.service import ShardService

log = logging.getLogger(__name__)

MAX_UNREAD_REPLIES = 4  # weight replies per client that ZeroMQ may still be sending
TICK_S = 0.1  # how often timers run, however busy the socket is
STALL_S = 0.5  # timers this late mean the loop did not run: waves' silence does not count it
GC_GRACE_S = 0.02  # longest wait for pyzmq to report a delivered reply before refusing
GC_GRACE_PER_TURN_S = 0.02  # all such waits in one loop turn together, however many non-readers


class BindError(RuntimeError):
    """The shard could not listen on its address (in use, not this host's, bad interface)."""


class ShardServer:
    """Serves one shard of the parameters over a ROUTER socket bound to ``config.bind``."""

    def __init__(self, config: PSConfig, context: zmq.Context | None = None):
        self.config = config
        check_bind(config.bind, secure=bool(config.curve_secret), insecure=config.insecure)
        self._sending: dict[bytes, list[zmq.MessageTracker]] = defaultdict(list)
        self._grace_left = GC_GRACE_PER_TURN_S
        self._refused: set[bytes] = set()  # peers refused for unread replies, until they read
        self._peer_fd: dict[bytes, int] = {}  # connection of each peer, to notice it close
        self.bytes_in = 0  # over ZeroMQ (shared-memory tensors are not counted here)
        self.bytes_out = 0
        token = load_admin_token(config.admin_token_path) if config.admin_token_path else ""
        admin_key = public_key_z85(config.curve_admin_key) if config.curve_admin_key else ""
        self.service = ShardService(
            config, token, weights_in_use=self._weights_in_flight, admin_key=admin_key
        )
        self.context = context or zmq.Context.instance()
        self.security = None
        if config.curve_secret:
            self.security = ServerSecurity(
                self.context, config.curve_secret, config.curve_authorized
            )
        self.socket = self.context.socket(zmq.ROUTER)
        if self.security:
            self.security.apply(self.socket)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, int(config.max_message_mib * (1 << 20)))
        try:
            self.socket.bind(config.bind)
        except zmq.ZMQError as e:
            self.socket.close(linger=0)
            self.service.close()  # releases its segment lock
            if self.security:
                self.security.stop()
            raise BindError(
                f"cannot listen on {config.bind}: {e.strerror}; pick another port "
                "(port 0 picks a free one) or stop what uses it"
            ) from None
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        # Closed connections release the waves they registered (ps/owners.py).
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    @property
    def shard(self):
        return self.service.shard

    # --- the loop ---------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until ``stop()`` (a signal handler may call it) or a ``shutdown`` request.
        The ready file is written here, once everything the daemon starts with (its metrics
        endpoint too) is up, so a launcher never takes a shard that is about to fail for ready."""
        log.info("shard %d serving on %s", self.config.shard_index, self.address)
        if self.config.ready_file:
            _write_atomically(Path(self.config.ready_file), self.address)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        try:
            while not self.service.stopping:
                wait_ms = max(0.0, next_tick - time.monotonic()) * 1000
                if poller.poll(wait_ms):
                    # Drain what is queued, but run the timers on time even if it never empties.
                    self._grace_left = GC_GRACE_PER_TURN_S
                    while not self.service.stopping and time.monotonic() < next_tick:
                        try:
                            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.bytes_in += sum(len(f) for f in frames[1:])
                        # a connection that closed before this message came is forgotten first,
                        # so that a new one on a reused descriptor is not taken for it
                        self._connections_closed()
                        peer = self._peer(frames)
                        self._send_all(self.service.handle(peer, frames[1:]))
                now = time.monotonic()
                if now >= next_tick:
                    self._send_all(self.service.tick(stalled_s=self._stalled(now - next_tick)))
                    next_tick = time.monotonic() + TICK_S
        finally:
            self.close()

    def stop(self) -> None:
        self.service.stopping = True

    def _stalled(self, late_s: float) -> float:
        """Seconds the timers ran late by that this loop did not run (the process stopped or
        starved of CPU, or one long request): what queued heartbeats could not be read in."""
        if late_s <= STALL_S:
            return 0.0
        if late_s > 1.0:
            log.warning(
                "shard %d did not run for %.1f s (stopped, or starved of CPU): that time does "
                "not count towards any wave's silence",
                self.config.shard_index,
                late_s,
            )
        return late_s

    def close(self) -> None:
        try:
            self._send_all(self.service.close())
        finally:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
            self.socket.close(linger=500)
            if self.security:
                self.security.stop()
        log.info(
            "shard %d stopped at version %d", self.config.shard_index, self.service.shard.version
        )

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

    def _connections_closed(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            fd = int(event["value"])
            for identity in [i for i, f in self._peer_fd.items() if f == fd]:
                del self._peer_fd[identity]
                self._sending.pop(identity, None)
                self._refused.discard(identity)
                self._send_all(self.service.connection_closed(identity))

    # --- sending ------------------------------------------------------------------------------

    def _send_all(self, messages: list[Outgoing]) -> None:
        for answer in _answers(messages):
            self._send(answer)

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

    def _weights_in_flight(self) -> bool:
        """Whether ZeroMQ still reads any weight reply's memory (pruning finished sends)."""
        busy = False
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


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
