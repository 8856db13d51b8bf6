"""ShardLinks: one wave's connection to each shard, and what the wave knows of its health.

Each shard gets a DEALER (ZeroMQ sockets are not thread-safe, and separate sockets keep the
waves' traffic apart) with a monitor whose events tell a restarted shard (its connection dropped
and came back) from one that is gone (down past ``lost_after_s``), and ZMTP heartbeats, so that a
host that vanishes without closing its connections is noticed as well. A shard that has a
standby (``docs/faults.md``) can be followed there: ``move`` points link ``i`` at another
address.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from wavelet.common.security import ClientKeys
from wavelet.worker.connection import dealer

# what the monitors report: a connection lost, one (re)made, and attempts that found nobody
EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED
HEARTBEAT_IVL_MS = 1000  # ZMTP pings on an idle connection


@dataclass
class Link:
    """What the wave knows of one shard's connection."""

    address: str
    socket: zmq.Socket
    monitor: zmq.Socket
    standby: str = ""  # where the shard's standby listens ("" : it has none)
    connected: bool = False  # a handshake succeeded since the socket was made
    down_since: float | None = None  # monotonic time the connection was lost (or never made)
    restarted: bool = False  # the connection came back: the shard may have restarted
    moved: bool = False  # this is the shard's standby, which took it over


class ShardLinks:
    def __init__(
        self,
        context: zmq.Context,
        addresses: list[str],
        keys: ClientKeys | None,
        timeout_s: float,
        lost_after_s: float,
    ):
        self.context, self.keys = context, keys
        self.timeout_s = timeout_s
        self.lost_after_s = lost_after_s
        self.poller = zmq.Poller()
        self.links = [self._link(a) for a in addresses]
        self._index: dict[zmq.Socket, tuple[bool, int]] = {}
        for i, link in enumerate(self.links):
            self._register(i, link)

    def __len__(self) -> int:
        return len(self.links)

    def __getitem__(self, i: int) -> Link:
        return self.links[i]

    @property
    def addresses(self) -> list[str]:
        return [link.address for link in self.links]

    def _link(self, address: str) -> Link:
        # Reconnect to a restarted shard with backoff: 0.1 s, doubling up to 5 s. ZMTP pings
        # every second; a peer silent for the lost time is disconnected (a vanished host).
        ttl_ms = int(self.lost_after_s * 1000)
        s = dealer(
            self.context,
            self.keys,
            {
                zmq.RECONNECT_IVL: 100,
                zmq.RECONNECT_IVL_MAX: 5000,
                zmq.SNDTIMEO: int(self.timeout_s * 1000),  # never block forever on send
                zmq.HEARTBEAT_IVL: HEARTBEAT_IVL_MS,
                zmq.HEARTBEAT_TIMEOUT: ttl_ms,
                zmq.HEARTBEAT_TTL: ttl_ms,
            },
        )
        monitor = s.get_monitor_socket(EVENTS)  # before connecting: no event is missed
        s.connect(address)
        return Link(address, s, monitor)

    def _register(self, i: int, link: Link) -> None:
        self.poller.register(link.socket, zmq.POLLIN)
        self.poller.register(link.monitor, zmq.POLLIN)
        self._index[link.socket] = (False, i)
        self._index[link.monitor] = (True, i)

    def which(self, sock: zmq.Socket) -> tuple[bool, int]:
        """(is it a monitor, the shard's index) of a socket the poller found ready; index -1
        for one closed since (its link moved while the same poll's other sockets were read)."""
        return self._index.get(sock, (False, -1))

    def take_event(self, i: int) -> None:
        """Read one event of link ``i``'s monitor, if one is there, and note what it says."""
        link = self.links[i]
        try:
            event = recv_monitor_message(link.monitor, zmq.NOBLOCK)["event"]
        except zmq.Again:
            return
        now = time.monotonic()
        if event == zmq.EVENT_DISCONNECTED:
            if link.down_since is None:
                link.down_since = now
        elif event == zmq.EVENT_CONNECT_RETRIED:
            # nobody listens there any more; one that never answered is a wrong address or a
            # shard still starting: the request timeout speaks for those
            if link.connected and link.down_since is None:
                link.down_since = now
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if link.connected and link.down_since is not None:
                # The shard is back; it may have restarted from an older checkpoint.
                link.restarted = True
            link.connected = True
            link.down_since = None

    def watch(self, block_ms: int = 0) -> None:
        for i, link in enumerate(self.links):
            while link.monitor.poll(block_ms):
                self.take_event(i)

    def answered(self, i: int) -> None:
        """A reply came from shard ``i``: its connection is up, whatever the events said."""
        link = self.links[i]
        link.connected = True
        link.down_since = None

    def down_for(self, i: int) -> float:
        """How long link ``i`` has been without a connection (0 while it has one)."""
        since = self.links[i].down_since
        return 0.0 if since is None else time.monotonic() - since

    def lost(self, i: int) -> bool:
        """Shard ``i``'s connection has been down past ``lost_after_s``."""
        return self.down_for(i) > self.lost_after_s

    def move(self, i: int, address: str) -> None:
        """Point link ``i`` at ``address`` (a standby that took the shard over, or back)."""
        old = self.links[i]
        self._close(old)
        link = self._link(address)
        link.moved = address == old.standby
        link.standby = "" if link.moved else old.standby
        self.links[i] = link
        self._register(i, link)

    def close(self) -> None:
        for link in self.links:
            self._close(link)

    def _close(self, link: Link) -> None:
        for sock in (link.socket, link.monitor):
            try:
                self.poller.unregister(sock)
            except KeyError:
                pass
            self._index.pop(sock, None)
        link.socket.disable_monitor()
        link.monitor.close(linger=0)
        link.socket.close(linger=0)
