"""The standby of a shard: a second copy of one shard, hosted by another shard's process, that
takes the shard over when its primary is lost (docs/faults.md).

Until then it serves nobody: it takes the primary's ``seed`` and ``replicate`` messages
(``ps/replication.py``) and answers a wave's request with ``not_primary``. It takes over when a
wave asks for the shard and the primary is gone: its connection closed (the process died, or
its host closed it), it went silent past ``shard_timeout_s`` (ZMTP heartbeats), it never came,
or it handed itself over (``seed`` with ``promote``). The waves then register with it at the
clocks it has from the primary and go on; without ``shard_replicas = 2`` it holds no updates,
and takes the newest checkpoint it can read, else the weights of the first wave that comes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from wavelet.common.messages import Ack, ReplicaUpdate, Seed
from wavelet.common.protocol import ErrorCode, Header, Op, ProtocolError
from wavelet.ps.owners import Peer
from wavelet.ps.replication import state_from_wire
from wavelet.ps.synchronous import OpenSteps, SyncGroups

log = logging.getLogger(__name__)

# what a standby answers before it takes over; anything else from a wave may promote it
STANDBY_OPS = (Op.SEED, Op.REPLICATE, Op.STATS, Op.HEARTBEAT, Op.CHECKPOINT, Op.SHUTDOWN)
# after a take-over from a lost primary: how long the waves it knew count as live without
# registering here (the survivors re-join within a second; the lost node's never do)
REJOIN_GRACE_S = 2.0
HANDOVER_GRACE_S = 3.0  # after a hand-over: the waves were told where it went (moved)


class StandbyRole:
    """The standby side of ``service`` (a ShardService of the shard it stands by for)."""

    def __init__(self, service, lost_after_s: float, on_promoted: Callable[[], None]):
        self.service = service
        self.lost_after_s = lost_after_s
        self.on_promoted = on_promoted
        self.started = time.monotonic()
        self.primary: bytes | None = None  # the primary's connection, once it seeded us
        self.primary_lost_at: float | None = None
        self.handed_over = False
        self.promoted = False
        self.clocks: list[list] = []  # the waves' clocks as of the primary's last message
        # a hand-over's open synchronous steps, taken on with the clocks at the take-over (the
        # standby closes no step before: it knows no wave until then)
        self.open_steps: OpenSteps | None = None
        self.seeds = 0
        self.updates = 0

    # --- from the primary ---------------------------------------------------------------------

    def seed(self, peer: Peer, h: Header, body: Seed, tensors) -> Ack:
        self._from_primary(h, peer, body.token)
        shard = self.service.shard
        # a primary that seeds us again after a hand-over is serving on (it never saw our ack
        # in time): the hand-over is withdrawn, or a wave could make two owners of the shard
        if self.handed_over and not body.promote:
            log.warning("standby of shard %d: its primary withdrew its hand-over", self._index)
        self.handed_over = False
        if body.hello:
            return Ack(shard.version)
        state = state_from_wire(body.state, list(tensors))
        steps = None
        if body.promote and body.open_steps:  # read whole before anything changes
            shapes = _gradient_shapes(state)
            steps = SyncGroups.read_open(state_from_wire(body.open_steps, list(tensors)), shapes)
        if not shard.initialized:
            shard.load_state_dict(state)
        else:  # a newer state of the same shard: the same plan, new values
            shard.check_plan(state.get("plan", ""))
            shard.reload(state)
        self.clocks = body.clocks
        self.open_steps = steps
        self.seeds += 1
        if body.promote:
            self.handed_over = True
            log.info("standby of shard %d: its primary handed itself over", self._index)
        return Ack(shard.version)

    def replicate(self, peer: Peer, h: Header, body: ReplicaUpdate, tensors) -> Ack:
        self._from_primary(h, peer, body.token)
        shard = self.service.shard
        if not shard.initialized or body.version != shard.version + 1:
            # a gap (a lost message): say where we are, and the primary seeds us again
            raise ProtocolError(
                ErrorCode.STALE_CLOCK,
                f"standby at version {shard.version} cannot apply version {body.version}: seed it",
            )
        n = len(body.keys)
        if len(tensors) != n + len(body.buffers):
            raise ProtocolError(ErrorCode.MALFORMED, "replicate: one frame per key and buffer")
        shard.apply(
            {k: t.clone() for k, t in zip(body.keys, tensors[:n], strict=True)}, body.lr_scale
        )
        for key, value in zip(body.buffers, tensors[n:], strict=True):
            shard.set_buffer(key, value)
        self.clocks = body.clocks
        self.updates += 1
        return Ack(shard.version)

    def _from_primary(self, h: Header, peer: Peer, token: str) -> None:
        self.service.admin.check(h.op, peer, token)
        if self.promoted:
            # the old primary woke (stopped, starved or cut off past the lost time) or its
            # hand-over's ack came late: it must serve nobody, and tells its waves to come here
            raise ProtocolError(
                ErrorCode.MOVED,
                f"this standby took shard {self._index} over; the old primary must not serve it",
            )
        self.primary = peer.identity
        self.primary_lost_at = None

    # --- from waves ---------------------------------------------------------------------------

    def admit(self, op: str) -> None:
        """A wave's request: serve it if this standby has taken the shard over or takes it over
        now; refuse it (``not_primary``) while the primary is alive."""
        if self.promoted or op in STANDBY_OPS:
            return
        why = self._primary_gone()
        if why is None:
            raise ProtocolError(
                ErrorCode.NOT_PRIMARY,
                f"this is the standby of shard {self._index} and its primary is alive; "
                "ask the primary",
            )
        self.promote(why)

    def _primary_gone(self) -> str | None:
        now = time.monotonic()
        if self.handed_over:
            return "its primary handed itself over"
        if self.primary_lost_at is not None:
            return "its primary's connection closed"
        if self.primary is None and now - self.started > self.lost_after_s:
            return f"its primary never came in {self.lost_after_s:g} s"
        return None

    def promote(self, why: str) -> None:
        self.promoted = True
        service = self.service
        # The waves the primary knew hold the others back until they register here: a short
        # grace to do so (the survivors come within a second; a lost node's never do).
        timeout = service.config.job.wave_timeout_s
        grace = HANDOVER_GRACE_S if self.handed_over else REJOIN_GRACE_S
        lease = min(grace, timeout)
        service.took_over(self.clocks, lease)
        if self.open_steps is not None:
            service.updates.sync.take_open(self.open_steps)
        log.warning(
            "standby of shard %d takes the shard over (%s) at version %d%s",
            self._index,
            why,
            service.shard.version,
            "" if service.shard.initialized else ", with no state: the first wave seeds it",
        )
        self.on_promoted()

    def connection_closed(self, identity: bytes) -> None:
        if identity == self.primary and self.primary_lost_at is None:
            self.primary_lost_at = time.monotonic()
            log.warning("standby of shard %d: its primary's connection closed", self._index)

    @property
    def _index(self) -> int:
        return self.service.config.shard_index

    def describe(self) -> dict:
        return {
            "role": "promoted" if self.promoted else "standby",
            "seeds": self.seeds,
            "replicated_updates": self.updates,
        }


def _gradient_shapes(state: dict) -> dict[int, tuple[torch.Size, torch.dtype]]:
    """Each trainable chunk's (shape, dtype) in a seed's shard state: what its sums must be."""
    try:
        chunks = zip(state["keys"], state["values"], state["trainable"], strict=True)
        return {k: (v.shape, v.dtype) for k, v, trainable in chunks if trainable}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(
            ErrorCode.MALFORMED, f"a seed's shard state is malformed: {e}"
        ) from None
