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

from wavelet.common.config import PSConfig
from wavelet.common.protocol import ErrorCode, error_header, send_message
from wavelet.common.security import ServerSecurity, check_bind, load_admin_token
from wavelet.ps.service import Outgoing, ShardService

log = logging.getLogger(__name__)

MAX_UNREAD_REPLIES = 4  # weight replies per client that ZeroMQ may still be sending
TICK_S = 0.1  # how often timers run, however busy the socket is
GC_GRACE_S = 0.02  # longest wait for pyzmq to report a delivered reply before refusing


class BindError(RuntimeError):
    """The shard could not listen on its address (in use, not this host's, bad interface)."""


class ShardServer:
    """Serves one shard of the parameters over a ROUTER socket bound to ``config.bind``."""

    def __init__(self, config: PSConfig, context: zmq.Context | None = None):
        self.config = config
        check_bind(config.bind, secure=bool(config.curve_secret), insecure=config.insecure)
        self._sending: dict[bytes, list[zmq.MessageTracker]] = defaultdict(list)
        self.bytes_in = 0  # over ZeroMQ (shared-memory tensors are not counted here)
        self.bytes_out = 0
        token = load_admin_token(config.admin_token_path) if config.admin_token_path else ""
        self.service = ShardService(config, token, weights_in_use=self._weights_in_flight)
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
            if self.security:
                self.security.stop()
            raise BindError(
                f"cannot listen on {config.bind}: {e.strerror}; pick another port "
                "(port 0 picks a free one) or stop what uses it"
            ) from None
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if config.ready_file:
            _write_atomically(Path(config.ready_file), self.address)

    @property
    def shard(self):
        return self.service.shard

    # --- the loop ---------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until ``stop()`` (a signal handler may call it) or a ``shutdown`` request."""
        log.info("shard %d serving on %s", self.config.shard_index, self.address)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        try:
            while not self.service.stopping:
                wait_ms = max(0.0, next_tick - time.monotonic()) * 1000
                if poller.poll(wait_ms):
                    # Drain what is queued, but run the timers on time even if it never empties.
                    while not self.service.stopping and time.monotonic() < next_tick:
                        try:
                            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.bytes_in += sum(len(f) for f in frames[1:])
                        self._send_all(self.service.handle(frames[0].bytes, frames[1:]))
                if time.monotonic() >= next_tick:
                    self._send_all(self.service.tick())
                    next_tick = time.monotonic() + TICK_S
        finally:
            self.close()

    def stop(self) -> None:
        self.service.stopping = True

    def close(self) -> None:
        self._send_all(self.service.close())
        self.socket.close(linger=500)
        if self.security:
            self.security.stop()
        log.info(
            "shard %d stopped at version %d", self.config.shard_index, self.service.shard.version
        )

    # --- sending ------------------------------------------------------------------------------

    def _send_all(self, messages: list[Outgoing]) -> None:
        for m in messages:
            self._send(m)

    def _send(self, m: Outgoing) -> None:
        self.bytes_out += sum(t.nbytes for t in m.tensors) + 64  # tensors and a header, about
        if not m.carries_weights:
            send_message(self.socket, m.header, m.tensors, prefix=[m.peer])
            return
        unread = [t for t in self._sending[m.peer] if not t.done]
        if len(unread) >= MAX_UNREAD_REPLIES:
            # A tracker turns done only once pyzmq's garbage-collector thread has run, which this
            # loop (holding the GIL) can delay: give it a moment before calling a client a
            # non-reader, or an honest client with replies long delivered would be refused.
            try:
                unread[0].wait(GC_GRACE_S)
            except zmq.NotDone:
                pass
            unread = [t for t in unread if not t.done]
        self._sending[m.peer] = unread
        if len(unread) >= MAX_UNREAD_REPLIES:
            message = (
                f"{len(unread)} earlier replies to this client are still unsent (it does not "
                "read them); read replies before sending more requests"
            )
            log.warning("refused a read: %s", message)
            self.service.count_refusal(ErrorCode.LIMIT)
            send_message(
                self.socket,
                error_header(m.header.request_id, ErrorCode.LIMIT, message),
                prefix=[m.peer],
            )
            return
        tracker = send_message(self.socket, m.header, m.tensors, prefix=[m.peer], track=True)
        if tracker is not None:
            unread.append(tracker)

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


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
