"""ShardService: one shard's state and every decision about it, with no sockets.

``handle(peer, frames)`` decodes one request and returns the messages to send (its reply, and the
parked pulls it released); ``tick(now)`` runs the timers (silent waves, periodic checkpoints).
Both never raise: a refused request becomes an ``error`` reply and leaves the parameters as they
were. The transport (``ps/server.py``) only moves frames, as ps-lite's ``KVServer`` hands requests
to one handler; so most behaviour is testable in-process, without a socket.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wavelet.common.config import PSConfig
from wavelet.common.protocol import (
    Ack,
    AdminRequest,
    AttachReply,
    AttachRequest,
    CheckpointReply,
    ErrorCode,
    Header,
    HeartbeatRequest,
    InitReply,
    InitRequest,
    Op,
    ProtocolError,
    PullRequest,
    PushReply,
    PushRequest,
    RegisterReply,
    RegisterRequest,
    StatsReply,
    WeightsReply,
    decode,
    error_header,
    reply_header,
    request_body,
    wave_name,
)
from wavelet.ps.admin import AdminGate
from wavelet.ps.checkpoints import Checkpointer
from wavelet.ps.datapath import Outgoing, ShardDataPath
from wavelet.ps.owners import Peer, WaveOwners
from wavelet.ps.policy import make_policy
from wavelet.ps.shard import Shard
from wavelet.ps.staleness import ClockTable, StalenessBound, WaveId, WaveStats
from wavelet.ps.synchronous import SyncSum

log = logging.getLogger(__name__)

@dataclass
class _ParkedPull:
    peer: bytes
    request_id: int
    wave: WaveId
    clock: int
    since: float
    action: str = ""  # what became of the push that came with this pull
    shm: bool = False  # answer through the wave's pull segment


class ShardService:
    """The state of one shard (parameters, clocks, parked pulls, statistics) and its rules.

    ``weights_in_use`` tells whether the transport still reads the parameters' memory; the shard
    then moves its parameters to fresh memory before an update instead of waiting (ps/shard.py).
    """

    def __init__(
        self,
        config: PSConfig,
        admin_token: str = "",
        weights_in_use: Callable[[], bool] = lambda: False,
        admin_key: str = "",
    ):
        self.config = config
        job = config.job
        self.shard = Shard(job.optimizer, weights_in_use)
        self.clocks = ClockTable()
        self.bound = StalenessBound(job.staleness)
        self.policy = make_policy(job.stale_policy, job.drop_limit, job.dc_lambda)
        self.sync = SyncSum()
        self.owners = WaveOwners()
        self.max_waves = config.wave_limit
        self.stats: dict[WaveId, WaveStats] = {}
        self.parked: list[_ParkedPull] = []
        self.rejected = 0
        self.rejected_by_code: Counter[str] = Counter()
        self.stopping = False
        self.admin = AdminGate(admin_token, admin_key)
        self._handlers: dict[str, Callable[..., Any]] = {
            op: getattr(self, f"rpc_{op}") for op in Op if op not in (Op.REPLY, Op.ERROR)
        }
        self.datapath = ShardDataPath(config, os.getpid())
        self.checkpoints = Checkpointer(config, self.shard, self.clocks)
        # waves of a restored shard keep their clocks but register again before they push
        for wave, clock in self.checkpoints.restore():
            self.clocks.join(wave, clock)
            self.stats.setdefault(wave, WaveStats())
        self._start_version = self.shard.version

    @property
    def updates_applied(self) -> int:
        """Updates this process applied (the version also counts those restored)."""
        return self.shard.version - self._start_version

    def count_refusal(self, code: str) -> None:
        self.rejected += 1
        self.rejected_by_code[str(code)] += 1

    # --- the two entry points -----------------------------------------------------------------

    def handle(self, peer: bytes | Peer, frames: Sequence[Any]) -> list[Outgoing]:
        """Answer one request (``frames`` without the routing frame) from ``peer``, the
        connection it came on; never raises."""
        peer = peer if isinstance(peer, Peer) else Peer(peer)
        out: list[Outgoing] = []
        request_id = 0
        header: Header | None = None
        try:
            header, tensors = decode(frames)
            request_id = header.request_id
            body = request_body(header)
            reply = self._handlers[header.op](peer, header, body, tensors)
        except ProtocolError as e:
            out.append(self._reject(peer.identity, request_id, e.code, e.message, header))
            return out
        except Exception as e:  # a bug, not the client's fault: say so and keep serving
            log.error("internal error:\n%s", traceback.format_exc())
            out.append(
                self._reject(
                    peer.identity,
                    request_id,
                    ErrorCode.INTERNAL,
                    f"{type(e).__name__}: {e}",
                    header,
                )
            )
            return out
        if isinstance(reply, list):
            out += reply
        elif reply is not None:
            out.append(reply)
        return out + self._housekeeping()

    def tick(self, now: float | None = None) -> list[Outgoing]:
        """Timers: drop waves silent past ``wave_timeout_s``, checkpoint when due; never
        raises."""
        out: list[Outgoing] = []
        try:
            timeout = self.config.job.wave_timeout_s
            for wave in self.clocks.silent(timeout, now):
                log.warning(
                    "wave %s silent for over %.0fs: dropped from the membership so the others "
                    "go on; it rejoins when it comes back",
                    wave_name(*wave),
                    timeout,
                )
                out += self._leave(wave, "it was silent too long; register again")
        except Exception:
            log.error("internal error in the timers:\n%s", traceback.format_exc())
        return out + self._housekeeping()

    def connection_closed(self, identity: bytes) -> list[Outgoing]:
        """The transport saw connection ``identity`` close: its waves may be claimed again."""
        for wave in self.owners.connection_closed(identity):
            log.info("wave %s: its connection closed", wave_name(*wave))
        return []

    def _housekeeping(self) -> list[Outgoing]:
        """After every request and timer: complete a bulk-synchronous sum, release the pulls
        that may now read, checkpoint when due. Guarded like a request: a failure here is
        logged and answered, never the end of the shard."""
        try:
            self._apply_sum_if_complete()
            out = self._release_parked()
        except Exception:
            log.error("internal error releasing parked pulls:\n%s", traceback.format_exc())
            out = self._answer_parked(
                lambda p: True, ErrorCode.INTERNAL, "internal error; pull again"
            )
        self.checkpoints.maybe()
        return out

    def close(self) -> list[Outgoing]:
        """Final checkpoint; error replies for the pulls still parked. Each step runs whatever
        the one before raised, so segments are always removed."""
        try:
            self.checkpoints.close()
        finally:
            out = self._answer_parked(lambda p: True, ErrorCode.SHUTTING_DOWN, "shutting down")
            self.datapath.close()
        return out

    # --- requests -----------------------------------------------------------------------------

    def rpc_register(self, peer: Peer, h: Header, body: RegisterRequest, tensors) -> Outgoing:
        wave = self._wave_of(h)
        if self.shard.initialized:
            self.shard.check_plan(h.plan)
        if wave not in self.clocks.clocks:
            self._make_room_for_a_wave()
        self.owners.claim(wave, peer)  # refused while another open connection owns it
        if body.resume and wave in self.clocks.clocks:
            clock = self.clocks.clocks[wave]  # a resumed job goes on where it stopped
        elif body.exact:
            clock = max(h.clock, 0)  # a wave re-joining at the clock it has on other shards
        else:
            # A wave that (re)joins a running job starts at the slowest live wave's clock, so
            # it does not hold the others back under the staleness bound.
            others = [
                c for w, c in self.clocks.clocks.items() if w in self.clocks.live and w != wave
            ]
            clock = max(h.clock, min(others, default=0), 0)
        self.clocks.join(wave, clock)
        self.stats.setdefault(wave, WaveStats())
        log.info("wave %s joined at clock %d", wave_name(*wave), clock)
        lost = self.checkpoints.lost_on_restore if body.resume else 0
        return self._reply(
            peer,
            h,
            RegisterReply(self.shard.version, clock, self.shard.initialized, lost),
        )

    def rpc_heartbeat(self, peer: Peer, h: Header, body: HeartbeatRequest, tensors) -> Outgoing:
        for index in body.waves:
            wave = (h.worker, index)
            # only a wave whose registering connection is still open is kept alive this way
            if wave in self.clocks.live and self.owners.bound(wave):
                self.clocks.seen(wave)
        return self._reply(peer, h, Ack(self.shard.version))

    def rpc_init(self, peer, h: Header, body: InitRequest, tensors) -> Outgoing:
        seeded = self.shard.initialize(h.plan, h.keys, tensors, body.trainable)
        return self._reply(peer, h, InitReply(self.shard.version, seeded))

    def rpc_pull(self, peer, h: Header, body: PullRequest, tensors) -> Outgoing | None:
        if body.observer:
            # Evaluation and tools read the current weights; they are not a wave and never park.
            self.shard.check_plan(h.plan)
            return self._weights(peer, h.request_id, None, h.clock, parked_s=0.0)
        wave = self._registered(h, peer)
        self.datapath.check_pull(wave, body.shm)
        self._check_park_room()
        return self._pull_or_park(peer, h.request_id, wave, h.clock, shm=body.shm)

    def rpc_push(self, peer, h: Header, body: PushRequest, tensors) -> Outgoing:
        _, action = self._push(peer, h, body, tensors)
        return self._reply(peer, h, PushReply(self.shard.version, action))

    def rpc_push_pull(self, peer, h: Header, body: PushRequest, tensors) -> Outgoing | None:
        self._check_park_room()  # before the push: a refused request must change nothing
        wave, action = self._push(peer, h, body, tensors)
        clock = self.clocks.clocks[wave]
        return self._pull_or_park(peer, h.request_id, wave, clock, action, shm=body.shm)

    def rpc_leave(self, peer: Peer, h: Header, body, tensors) -> list[Outgoing]:
        wave = self._registered(h, peer)
        out = self._leave(wave, "the wave left")
        log.info("wave %s left at clock %d", wave_name(*wave), self.clocks.clocks[wave])
        return [*out, self._reply(peer, h, Ack(self.shard.version))]

    def rpc_attach(self, peer: Peer, h: Header, body: AttachRequest, tensors) -> list[Outgoing]:
        wave = self._registered(h, peer)
        self.shard.check_plan(h.plan)
        # segments are about to change: a shared-memory pull still parked would read the old
        out = self._answer_parked(
            lambda p: p.wave == wave and p.shm,
            ErrorCode.NOT_ATTACHED,
            "the wave attached again; pull again",
        )
        segments, reason = None, ""
        if body.transport == "tcp":
            self.datapath.detach(wave)
        else:
            segments, reason = self.datapath.attach(wave, self.shard.specs)
        if segments is None:
            self.stats[wave].transport = "tcp"
            tcp = AttachReply(self.shard.version, "tcp", reason=reason)
            return [*out, self._reply(peer, h, tcp)]
        self.stats[wave].transport = "shm"
        reply = AttachReply(
            version=self.shard.version,
            transport="shm",
            push_segment=segments.push.name,
            pull_segment=segments.pull.name,
            nonce=segments.push.nonce,
            size=segments.push.size,
            offsets=segments.offsets,
        )
        return [*out, self._reply(peer, h, reply)]

    def rpc_stats(self, peer, h: Header, body, tensors) -> Outgoing:
        waves = {}
        for wave, st in self.stats.items():
            waves[wave_name(*wave)] = {
                "clock": self.clocks.clocks.get(wave, 0),
                "live": wave in self.clocks.live,
                **st.summary(),
            }
        return self._reply(
            peer,
            h,
            StatsReply(
                version=self.shard.version,
                shard=self.config.shard_index,
                staleness_bound=str(self.bound.s),
                parked_now=len(self.parked),
                rejected=self.rejected,
                checkpoint_failures=self.checkpoints.failures,
                waves=waves,
            ),
        )

    def rpc_checkpoint(self, peer, h: Header, body: AdminRequest, tensors) -> Outgoing:
        self.admin.check(h.op, peer, body.token)
        path = self.checkpoints.write()
        return self._reply(peer, h, CheckpointReply(self.shard.version, str(path)))

    def rpc_shutdown(self, peer, h: Header, body: AdminRequest, tensors) -> Outgoing:
        self.admin.check(h.op, peer, body.token)
        self.stopping = True
        return self._reply(peer, h, Ack(self.shard.version))

    # --- pushes and pulls ---------------------------------------------------------------------

    def _push(
        self, peer: Peer, h: Header, body: PushRequest, tensors: list[torch.Tensor]
    ) -> tuple[WaveId, str]:
        """Validate a push completely, then apply or accumulate it."""
        wave = self._registered(h, peer)
        shard = self.shard
        shard.check_plan(h.plan)
        clock = self.clocks.clocks[wave]
        if h.clock != clock:
            raise ProtocolError(
                ErrorCode.STALE_CLOCK,
                f"push for clock {h.clock}, but wave {wave_name(*wave)} is at "
                f"clock {clock}; each clock is pushed once, in order",
            )
        if h.read_version < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "push needs the version it read (read >= 0)")
        if h.read_version > shard.version:
            raise ProtocolError(
                ErrorCode.FUTURE_VERSION,
                f"read version {h.read_version} is newer than this shard's version {shard.version}",
            )
        if wave not in self.clocks.live:
            raise ProtocolError(
                ErrorCode.NOT_REGISTERED, f"wave {wave_name(*wave)} left; register again to push"
            )
        if self.bound.synchronous and self.sync.open and clock != self.sync.clock:
            raise ProtocolError(
                ErrorCode.STALE_CLOCK,
                f"bulk-synchronous clock {self.sync.clock} is still open; "
                f"pull before pushing clock {clock}",
            )
        tensors = self.datapath.gradients(wave, body.shm, tensors)
        shard.check_push(h.keys, tensors)  # frames or a segment: validated alike
        lr_scale = body.lr_scale

        tau = shard.version - h.read_version
        grads = shard.gradients(tensors)
        shard.store_buffers(wave, tensors)
        if self.bound.synchronous:
            # Every gradient of the open clock read the same version (tau = 0): average them.
            self.sync.add(clock, grads, lr_scale)
            action = "accumulated"
        else:
            decision = self.policy.decide(wave, tau, grads, shard.params)
            action = decision.action
            if decision.grads is None:
                self.stats[wave].dropped += 1
            else:
                lr_scale *= decision.lr_scale
                shard.apply(decision.grads, lr_scale)
        self.clocks.advance(wave)
        self.stats[wave].record_push(tau)
        self.checkpoints.log_push(
            wave_name=wave_name(*wave),
            worker=wave[0],
            wave=wave[1],
            clock=clock,
            read_version=h.read_version,
            version=shard.version,
            staleness=tau,
            action=action,
            lr_scale=lr_scale,
            policy=self.policy.name,
        )
        self._apply_sum_if_complete()
        return wave, action

    def _apply_sum_if_complete(self) -> None:
        """Bulk-synchronous: apply the mean once every live wave has pushed the open clock
        (the pulls it unblocks are released by the caller)."""
        if not self.sync.open:
            return
        slowest = self.clocks.min_live_clock()
        if slowest is not None and slowest <= self.sync.clock:
            return
        grads, lr_scale = self.sync.mean()
        self.shard.apply(grads, lr_scale)

    def _pull_or_park(
        self,
        peer: bytes,
        request_id: int,
        wave: WaveId,
        clock: int,
        action: str = "",
        shm: bool = False,
    ) -> Outgoing | None:
        if self._may_read(clock):
            return self._weights(peer, request_id, wave, clock, 0.0, action, shm)
        self.parked.append(
            _ParkedPull(peer.identity, request_id, wave, clock, time.monotonic(), action, shm)
        )
        self.stats[wave].parked += 1
        return None

    def _check_park_room(self) -> None:
        if len(self.parked) >= self.config.max_parked:
            raise ProtocolError(
                ErrorCode.LIMIT,
                f"{len(self.parked)} pulls are parked already, "
                "the most this shard holds (max_parked)",
            )

    def _may_read(self, clock: int) -> bool:
        if not self.shard.initialized:
            return False
        if len(self.clocks.clocks) < self.config.expect_waves:
            return False  # start barrier: wait for the whole job to register
        if self.bound.synchronous and self.sync.open and clock > self.sync.clock:
            return False
        return self.bound.may_read(clock, self.clocks)

    def _release_parked(self) -> list[Outgoing]:
        out: list[Outgoing] = []
        if not self.parked:
            return out
        still = []
        for p in self.parked:
            if not self._may_read(p.clock):
                still.append(p)
                continue
            waited = time.monotonic() - p.since
            self.stats[p.wave].parked_s += waited
            try:
                out.append(
                    self._weights(p.peer, p.request_id, p.wave, p.clock, waited, p.action, p.shm)
                )
            except ProtocolError as e:  # e.g. its segments are gone: this pull alone fails
                out.append(self._reject(p.peer, p.request_id, e.code, e.message, None))
        self.parked = still
        return out

    def _answer_parked(self, which, code: ErrorCode, message: str) -> list[Outgoing]:
        """Answer the parked pulls ``which(pull)`` selects with an error, and forget them."""
        hit = [p for p in self.parked if which(p)]
        self.parked = [p for p in self.parked if not which(p)]
        return [Outgoing(p.peer, error_header(p.request_id, code, message)) for p in hit]

    def _weights(
        self,
        peer: Peer | bytes,
        request_id: int,
        wave: WaveId | None,
        clock: int,
        parked_s: float,
        action: str = "",
        shm: bool = False,
    ) -> Outgoing:
        slowest = self.clocks.min_live_clock()
        body = WeightsReply(
            version=self.shard.version,
            clock=clock,
            parked_s=parked_s,
            slowest_clock=-1 if slowest is None else slowest,
            action=action,
            shm=shm,
        )
        if wave is not None:
            self.stats[wave].record_read(clock, self.shard.version)
            if not self.bound.synchronous:
                self.policy.on_read(wave, self.shard.params)
        header = reply_header(request_id, body)
        header.keys = self.shard.keys
        peer = peer.identity if isinstance(peer, Peer) else peer
        return self.datapath.weights_reply(peer, header, self.shard.values(), wave, shm)

    # --- membership, admin, errors ------------------------------------------------------------

    def _leave(self, wave: WaveId, why: str) -> list[Outgoing]:
        """``wave`` leaves the membership: free what the shard kept for it (segments, DC-ASGD
        copy, buffer values) and answer its parked pulls; returns those answers."""
        self.clocks.leave(wave)
        self.owners.release(wave)
        self.policy.forget(wave)
        self.shard.forget_wave(wave)
        self.datapath.detach(wave)
        return self._answer_parked(lambda p: p.wave == wave, ErrorCode.NOT_REGISTERED, why)

    def _make_room_for_a_wave(self) -> None:
        """A new wave may register while fewer than ``max_waves`` are known; waves that left or
        were dropped (and are not connected) are forgotten first to make room."""
        if len(self.clocks.clocks) < self.max_waves:
            return
        for wave in [w for w in self.clocks.clocks if w not in self.clocks.live]:
            if not self.owners.bound(wave):
                self.clocks.forget(wave)
                self.stats.pop(wave, None)
                self.owners.forget(wave)
                if len(self.clocks.clocks) < self.max_waves:
                    return
        raise ProtocolError(
            ErrorCode.LIMIT,
            f"this shard serves at most {self.max_waves} waves (max_waves) and that many are "
            "registered",
        )

    def _wave_of(self, h: Header) -> WaveId:
        if not h.worker or h.wave < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "request needs worker and wave (>= 0)")
        return (h.worker, h.wave)

    def _registered(self, h: Header, peer: Peer) -> WaveId:
        """The wave ``h`` names, registered here by ``peer``'s connection (else refused)."""
        wave = self._wave_of(h)
        if wave not in self.clocks.clocks:
            raise ProtocolError(
                ErrorCode.NOT_REGISTERED,
                f"wave {wave_name(*wave)} has not registered with this shard",
            )
        self.owners.check(wave, peer)
        if wave in self.clocks.live:
            self.clocks.seen(wave)  # any request is a sign of life
        return wave

    def _reply(self, peer: Peer, h: Header, body) -> Outgoing:
        return Outgoing(peer.identity, reply_header(h.request_id, body))

    def _reject(
        self,
        peer: bytes,
        request_id: int,
        code: ErrorCode,
        message: str,
        header: Header | None,
    ) -> Outgoing:
        self.count_refusal(code)
        if header is not None and header.worker and header.wave >= 0:
            wave = (header.worker, header.wave)
            if wave in self.stats:
                self.stats[wave].rejected[str(code)] += 1
        log.warning("rejected request %d: [%s] %s", request_id, code, message)
        return Outgoing(peer, error_header(request_id, code, message))
