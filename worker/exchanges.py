"""A wave's requests on the wire: sending one message per shard and gathering the replies under
one deadline, following a shard that restarted, handed itself over or was lost (``Recovery``),
and the single requests that recovery and attaching make.

Mixed into ``PSClient`` (``worker/client.py``), whose sockets (``links``), request ids, stop
event and budget it uses; rounds (``worker/rounds.py``) drive an exchange part by part.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import zmq

from wavelet.common.protocol import (
    ErrorCode,
    Header,
    Op,
    ShardTimeout,
    decode_reply,
    raise_for_error,
    send_message,
)
from wavelet.worker.rounds import BudgetSpent, Exchange, PullParts, StopRequested


class Exchanges:
    """``PSClient``'s part that moves requests and replies between a wave and its shards."""

    def _exchange(
        self,
        messages: list[tuple[Header, list[torch.Tensor]]],
        recover: Callable[[int], tuple[Header, list[torch.Tensor]]] | None = None,
        pull: bool = False,
    ) -> Exchange:
        """Send message i to shard i, then gather every reply (or raise on the first error);
        ``pull``: the replies are weights, loaded as they come (``_open_exchange``).

        With ``recover``, a shard that restarted (its connection dropped and came back) is not
        waited for: ``recover(i)`` re-joins it and its result stands in for shard i's reply."""
        exchange = self._open_exchange(pull)
        for i, (h, tensors) in enumerate(messages):
            self._send_in(exchange, i, h, tensors, recover)
        self._gather(exchange, recover)
        return exchange

    def _open_exchange(self, pull: bool = False) -> Exchange:
        """A new request id's exchange; ``pull``: its replies are weights, loaded into our
        tensors part by part as they arrive (``PullParts``)."""
        self._watch_connections(block_ms=0)
        return Exchange(
            next(self._ids), [None] * len(self.links), pull=PullParts(self) if pull else None
        )

    def _send_in(self, exchange: Exchange, i: int, h: Header, tensors, recover) -> None:
        """Message ``h`` of ``exchange`` to shard ``i``, queued without waiting."""
        if recover is not None and self.links[i].restarted:
            exchange.take_rejoin(i, self._rejoin(i, recover))
            return
        h.request_id = exchange.request_id
        if not self._try_send(i, h, tensors):
            exchange.unsent[i] = (h, tensors)  # no connection yet: retried in _gather

    def _gather(
        self,
        exchange: Exchange,
        recover,
        until: Callable[[], bool] | None = None,
        once: bool = False,
    ) -> list[tuple[Header, list[torch.Tensor]]]:
        """Every reply of ``exchange`` (or raise on the first error), under one deadline; with
        ``until``, only until ``until()`` holds, and ``once``: only what has arrived, without
        waiting (some replies may then still be missing)."""
        rid, replies, unsent = exchange.request_id, exchange.replies, exchange.unsent
        deadline = time.monotonic() + self.timeout_s
        while any(r is None for r in replies) and not (until is not None and until()):
            if self.stop.is_set():
                raise StopRequested()
            if self.budget_ends is not None and time.monotonic() > self.budget_ends:
                raise BudgetSpent()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [self.addresses[i] for i, r in enumerate(replies) if r is None]
                raise ShardTimeout(
                    f"no reply within {self.timeout_s:.0f}s from shard(s) {', '.join(missing)}; "
                    "check that `wavelet ps` runs there and the address is right",
                    missing,
                )
            for i in [i for i in unsent if self._try_send(i, *unsent[i])]:
                del unsent[i]
            wait_s = 0.0 if once else min(left, 0.05 if unsent else 0.2)
            # Never a blocking read below: a re-join while handling one ready socket may read
            # what the same poll found ready on another (its reply, its connection events).
            for sock, _ in self.links.poller.poll(wait_s * 1000):
                monitor, i = self.links.which(sock)
                if i < 0:
                    continue  # closed since the poll: its link moved
                if monitor:
                    self._on_monitor_event(sock)
                    continue
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                h, tensors = decode_reply(frames, self.addresses[i])
                self.links.answered(i)
                if h.request_id != rid or replies[i] is not None:
                    continue  # a late answer to a request we gave up on or recovered from
                if h.op == Op.ERROR:
                    code = h.body.get("code")
                    if recover is not None and code == ErrorCode.NOT_REGISTERED:
                        # dropped from the membership (silent too long): join again
                        exchange.take_rejoin(i, self._rejoin(i, recover))
                        continue
                    if recover is not None and code == ErrorCode.MOVED and self.links[i].standby:
                        # the shard handed itself to its standby (it was stopped): follow it
                        self.links[i].down_since = time.monotonic()
                        exchange.take_rejoin(i, self._fail_over(i, recover, handed=True))
                        continue
                    raise_for_error(h, self.addresses[i])
                exchange.take(i, (h, tensors))
            for i, r in enumerate(replies):
                if r is not None:
                    continue
                link = self.links[i]
                if recover is not None and link.restarted:
                    unsent.pop(i, None)  # the re-join's pull stands in for it
                    exchange.take_rejoin(i, self._rejoin(i, recover))
                elif recover is not None and link.down_since is not None and link.standby:
                    unsent.pop(i, None)
                    exchange.take_rejoin(i, self._fail_over(i, recover))
                elif self.links.lost(i):
                    raise self._lost(i)
            if once:
                break
        return replies

    def _try_send(self, i: int, header: Header, tensors: list[torch.Tensor]) -> bool:
        """Queue a message for shard ``i`` without waiting; False while it cannot be queued."""
        try:
            send_message(self.links[i].socket, header, tensors, flags_nonblocking=True)
        except zmq.Again:
            return False
        return True

    def _send(self, i: int, header: Header, tensors: list[torch.Tensor]) -> None:
        try:
            send_message(self.links[i].socket, header, tensors)
        except zmq.Again:  # no connection to queue on within SNDTIMEO
            raise ShardTimeout(
                f"could not send to shard {self.addresses[i]} within {self.timeout_s:.0f}s; "
                "check that `wavelet ps` runs there, the address and, with CURVE, the keys",
                [self.addresses[i]],
            ) from None

    def _watch_connections(self, block_ms: int) -> None:
        for link in self.links.links:
            while link.monitor.poll(block_ms):
                self._on_monitor_event(link.monitor)

    def _on_monitor_event(self, mon: zmq.Socket) -> None:
        i = self.links.which(mon)[1]
        if i >= 0:
            self.links.take_event(i)

    def _request_one(self, i: int, header: Header, tensors=()) -> Header:
        return self._request_one_reply(i, header, tensors)[0]

    def _request_one_reply(self, i: int, header: Header, tensors=()):
        header.request_id = rid = next(self._ids)
        sock = self.links[i].socket
        self._send(i, header, list(tensors))
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.stop.is_set():
                raise StopRequested()
            if sock.poll(200):
                h, out = decode_reply(sock.recv_multipart(copy=False), self.addresses[i])
                self.links.answered(i)
                if h.request_id != rid:
                    continue
                raise_for_error(h, self.addresses[i])
                return h, out
            self.links.watch()
            if self.links.lost(i):
                raise self._lost(i)
        raise ShardTimeout(
            f"shard {self.addresses[i]} did not answer {header.op} within "
            f"{self.timeout_s:.0f}s after reconnecting",
            [self.addresses[i]],
        )
