"""Heartbeat: tells every shard which of this worker's waves are alive, every few seconds.

A wave busy in a long forward or parked on the staleness bound sends nothing for a while; the
heartbeat keeps it in the membership. A wave that died (or a worker killed outright) stops
heartbeating, and the shards drop it after ``wave_timeout_s`` so the others are not blocked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from wavelet.common.messages import HeartbeatRequest
from wavelet.common.protocol import Header, Op, send_message
from wavelet.common.security import ClientKeys
from wavelet.worker.connection import connect_dealer


class Heartbeat(threading.Thread):
    def __init__(
        self,
        addresses: list[str],  # where the shards are; a list the daemon updates as they move
        worker: str,
        live_waves: Callable[[], list[int]],
        every_s: float,
        context: zmq.Context,
        keys: ClientKeys | None = None,
    ):
        super().__init__(name="heartbeat", daemon=True)
        self.addresses = addresses
        self.worker = worker
        self.live_waves = live_waves
        self.every_s = every_s
        self.context = context
        self.keys = keys
        self.stopped = threading.Event()

    def run(self) -> None:
        sockets, targets = [], list(self.addresses)
        for a in targets:
            sockets.append(self._connect(a))
        try:
            while not self.stopped.wait(self.every_s):
                for i, a in enumerate(self.addresses):  # a standby took a shard over: follow it
                    if a != targets[i]:
                        sockets[i].close(linger=0)
                        sockets[i], targets[i] = self._connect(a), a
                header = Header(
                    op=Op.HEARTBEAT,
                    worker=self.worker,
                    body=HeartbeatRequest(waves=self.live_waves()).to_wire(),
                )
                for s in sockets:
                    try:
                        send_message(s, header, flags_nonblocking=True)
                    except zmq.Again:
                        pass
                    while s.poll(0):  # replies are only acknowledgements
                        s.recv_multipart()
        finally:
            for s in sockets:
                s.close(linger=0)

    def _connect(self, address: str) -> zmq.Socket:
        # a shard that is down gets a few heartbeats queued, not a backlog
        return connect_dealer(self.context, address, self.keys, {zmq.SNDHWM: 4})

    def stop(self) -> None:
        self.stopped.set()
