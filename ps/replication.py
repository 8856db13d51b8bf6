"""Replication: a shard's primary keeps its standby's copy of the shard in step.

The standby of shard ``i`` is hosted by another shard's process (the next one, on another node
where the job spans nodes). The primary connects to it at start and sends:

- ``seed``: its whole state (weights, optimizer state, version, the waves' clocks), when the
  standby first connects or needs it again, and when the primary hands itself over (stopping,
  or moving off a slow node), then with its open synchronous steps;
- ``replicate`` (``shard_replicas = 2``): every update it applies, as the gradients and learning
  rate it applied them with, so that the standby's optimizer takes the same step (the same
  arithmetic on the same values: the copies stay equal), and the clocks the update leaves;
- ``promote``: take the shard over now (the primary is stopping and handed its state over).

A standby that took the shard over refuses its old primary with ``moved`` (the primary was
stopped or cut off past the lost time and woke, or its hand-over's ack came late): the primary
then steps aside and sends its waves there, so that a shard never has two owners.

With replication on, the primary holds back every reply that would show a client a version its
standby has not acknowledged: whatever a client saw survives the primary. State travels as tensor
frames with a msgpack skeleton (``state_to_wire``), never pickled.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from wavelet.common.messages import ReplicaUpdate, Seed, reply_body
from wavelet.common.protocol import (
    ErrorCode,
    Header,
    Op,
    ProtocolError,
    decode_reply,
    send_message,
)

log = logging.getLogger(__name__)

HANDOFF_TIMEOUT_S = 10.0  # how long a stopping primary waits for its standby to take over


def state_to_wire(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """A msgpack-able skeleton of ``obj`` (dicts, lists, scalars, tensors: an optimizer's state
    dict) and the tensors it refers to by index, in order."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach().to("cpu").contiguous())
            return {"t": len(tensors) - 1}
        if isinstance(x, dict):
            return {"d": [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, list | tuple):
            return [walk(v) for v in x]
        if x is None or isinstance(x, bool | int | float | str):
            return x
        raise TypeError(f"cannot send a {type(x).__name__} in a shard's state")

    return walk(obj), tensors


def state_from_wire(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """``state_to_wire``'s inverse; a malformed skeleton is a ``malformed`` protocol error."""

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {"t"} and isinstance(x["t"], int) and 0 <= x["t"] < len(tensors):
                return tensors[x["t"]].clone()  # the frames are released after the request
            if set(x) == {"d"} and isinstance(x["d"], list):
                out = {}
                for pair in x["d"]:
                    if not (isinstance(pair, list) and len(pair) == 2):
                        break
                    key = walk(pair[0])
                    if not isinstance(key, int | str):
                        break
                    out[key] = walk(pair[1])
                else:
                    return out
            raise ProtocolError(ErrorCode.MALFORMED, "a shard state's skeleton is malformed")
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(skeleton)


class Replicator:
    """The primary's link to its standby: what it sent, what the standby acknowledged."""

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        shard_index: int,
        token: str,
        mirror: bool,
        keys=None,
        lost_after_s: float = 10.0,
    ):
        self.address = address
        self.shard_index = shard_index
        self.token = token
        self.mirror = mirror  # shard_replicas = 2: every update, not only seeds and handoffs
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IDENTITY, f"primary-{shard_index}".encode())
        ttl_ms = int(lost_after_s * 1000)
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, ttl_ms)
        self.socket.setsockopt(zmq.HEARTBEAT_TTL, ttl_ms)
        if keys is not None:
            keys.apply(self.socket)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self.socket.connect(address)
        self.connected = False
        self.seeded = False  # the standby holds this primary's state (as of ``sent``)
        self.sent = -1  # the newest version sent
        self.acked = -1  # the newest version the standby acknowledged
        self.updates_sent = 0
        self.bytes_sent = 0
        self._ids = 0
        # the standby took the shard over while this primary lived (it was stopped or cut off
        # past the lost time, or its hand-over's ack came late): this primary must step aside
        self.superseded = False

    @property
    def in_step(self) -> bool:
        """Replies may go out: the standby has every version they could show (or there is no
        standby to wait for: disconnected, or not mirroring)."""
        if self.superseded:
            return True  # nothing to wait for: the shard is the standby's now
        return not (self.mirror and self.connected and self.seeded) or self.acked >= self.sent

    def poll(self, service) -> None:
        """Connection events and acknowledgements; a (re)connected standby is seeded."""
        while self.monitor.poll(0):
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self.seeded = True, False
                log.info("shard %d: standby at %s connected", self.shard_index, self.address)
            elif event == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    log.warning(
                        "shard %d: its standby at %s is gone; no copy of this shard is kept "
                        "until it comes back",
                        self.shard_index,
                        self.address,
                    )
                self.connected, self.seeded = False, False
        while self.socket.poll(0):
            h, _ = decode_reply(self.socket.recv_multipart(copy=False), self.address)
            if h.op == Op.ERROR:
                if h.body.get("code") == ErrorCode.MOVED:
                    self.superseded = True
                    continue
                log.error("shard %d: its standby refused: %s", self.shard_index, h.body)
                self.seeded = False
                continue
            self.acked = max(self.acked, reply_body(Op.SEED, h).version)
        if self.connected and not self.seeded and not self.superseded:
            if not self.mirror:  # without mirroring only a handover seeds: say who we are
                self._send(Op.SEED, Seed(token=self.token, state={}, clocks=[], hello=True), [])
                self.seeded = True
            elif service.shard.initialized:
                self.seed(service)

    def seed(self, service, promote: bool = False) -> None:
        """The whole shard, as it is now, to the standby (``promote``: and take it over)."""
        # a hand-over passes the open synchronous steps on too: no push in them is given again
        # or lost; a copy kept in step holds applied updates only
        open_steps = service.updates.open_steps() if promote else {}
        (state, steps), tensors = state_to_wire([service.shard.state_dict(), open_steps])
        body = Seed(
            token=self.token,
            state=state,
            clocks=service.replicated_clocks(committed=not promote),
            promote=promote,
            open_steps=steps if open_steps else {},
        )
        self._send(Op.SEED, body, tensors)
        self.sent = service.shard.version
        self.seeded = True

    def replicate(
        self, service, grads: dict[int, torch.Tensor], lr_scale: float, version: int
    ) -> None:
        """One update the primary applied (``mirror``), reaching ``version``, with the clocks
        the request that made it left."""
        if not (self.mirror and self.connected and self.seeded) or self.superseded:
            return
        keys = sorted(grads)
        body = ReplicaUpdate(
            token=self.token,
            version=version,
            lr_scale=lr_scale,
            keys=keys,
            buffers=[k for k in service.shard.buffers],
            clocks=service.replicated_clocks(),
        )
        buffers = [service.shard.buffer_value(k) for k in body.buffers]
        self._send(Op.REPLICATE, body, [grads[k] for k in keys] + buffers)
        self.sent = version
        self.updates_sent += 1

    def hand_over(self, service) -> bool:
        """A stopping primary's last act: its state to the standby, which takes the shard over;
        True once the standby acknowledged (within ``HANDOFF_TIMEOUT_S``)."""
        if not (service.shard.initialized and self.connected):
            return False
        self.seed(service, promote=True)
        deadline = time.monotonic() + HANDOFF_TIMEOUT_S
        while time.monotonic() < deadline and self.connected:
            self.socket.poll(100)
            self.poll(service)
            if self.acked >= self.sent or self.superseded:
                return True
        # not acknowledged in time: the standby may hold the promotion, and this primary serves
        # on; seeding it again (or saying hello) withdraws it there
        self.seeded = False
        return False

    def _send(self, op: Op, body, tensors: list[torch.Tensor]) -> None:
        self._ids += 1
        header = Header(op=op, request_id=self._ids, body=body.to_wire())
        try:
            send_message(self.socket, header, tensors, flags_nonblocking=True)
        except zmq.Again:  # the standby is not there to queue on: seed it when it comes
            self.seeded = False
            return
        self.bytes_sent += sum(t.nbytes for t in tensors)

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)
