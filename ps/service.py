"""ShardService: one shard's state and every decision about it, with no sockets.

``handle(peer, frames)`` decodes one request and returns the messages to send (its reply, and the
parked pulls it released); ``tick(now)`` runs the timers (silent waves, periodic checkpoints).
Both never raise: a refused request becomes an ``error`` reply and leaves the parameters as they
were. The transport (``ps/server.py``) only moves frames, as ps-lite's ``KVServer`` hands requests
to one handler; so most behaviour is testable in-process, without a socket.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from wavelet.common.daemon_config import PSConfig
from wavelet.common.messages import (
    Ack,
    AdminRequest,
    AttachRequest,
    CheckpointReply,
    DescribeRequest,
    HeartbeatRequest,
    InitReply,
    InitRequest,
    JobDescription,
    PullRequest,
    PushReply,
    PushRequest,
    RegisterReply,
    RegisterRequest,
    StatsReply,
    reply_header,
    request_body,
)
from wavelet.common.protocol import (
    ErrorCode,
    Header,
    Op,
    ProtocolError,
    decode,
    error_header,
    wave_name,
)
from wavelet.ps.admin import AdminGate
from wavelet.ps.checkpoints import Checkpointer
from wavelet.ps.datapath import Outgoing, ShardDataPath
from wavelet.ps.membership import Membership
from wavelet.ps.owners import Peer
from wavelet.ps.parked import ParkedPulls
from wavelet.ps.push_parts import PushParts
from wavelet.ps.pushes import PushesAndReads
from wavelet.ps.shard import Shard
from wavelet.ps.staleness import WaveId
from wavelet.ps.standby import StandbyRole
from wavelet.ps.update_rules import Updates, shard_optimizer

log = logging.getLogger(__name__)


class ShardService(PushesAndReads):
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
        self.shard = Shard(shard_optimizer(job, config.expect_waves), weights_in_use)
        self.members = Membership(config.wave_limit)
        self.clocks, self.owners, self.stats = (
            self.members.clocks,
            self.members.owners,
            self.members.stats,
        )
        self.updates = Updates(job, config.expect_waves, self.shard, self.clocks)
        self.parked = ParkedPulls(config.max_parked)
        self.rejected = 0
        self.rejected_by_code: Counter[str] = Counter()
        self.stopping = False
        self.admin = AdminGate(admin_token, admin_key)
        self._handlers: dict[str, Callable[..., Any]] = {
            op: getattr(self, f"rpc_{op}") for op in Op if op not in (Op.REPLY, Op.ERROR)
        }
        self.datapath = ShardDataPath(config, os.getpid())
        self.push_parts = PushParts(lambda: self.shard.keys)
        self.checkpoints = Checkpointer(config, self.shard, self.clocks)
        self.members.on_change = self.checkpoints.log_membership
        self.standby: StandbyRole | None = None  # set where this service is a shard's standby
        self.standby_address = ""  # where this shard's own standby listens (told to waves)
        self.moved_to = ""  # the standby this shard handed itself over to (it is stopping)
        self.shut_down_by_admin = False  # the job's end: nothing to hand over
        # every shard's address, in order, where the daemon knows them (for --join)
        self.directory: Callable[[], list[str]] | None = None
        self.barrier_passed = False  # every expected wave registered once (or a take-over)
        if config.standby_role:
            self.checkpoints.enabled = False  # the primary's own until this takes it over
        else:
            # waves of a restored shard keep their clocks but register again before they push
            for wave, clock in self.checkpoints.restore():
                self.members.restore(wave, clock)
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
            if self.standby is not None:
                self.standby.admit(header.op)  # serves nobody until it takes the shard over
            if self.moved_to and header.op not in (Op.STATS, Op.HEARTBEAT, Op.SHUTDOWN):
                raise ProtocolError(ErrorCode.MOVED, f"the shard moved to {self.moved_to}")
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

    def tick(self, now: float | None = None, stalled_s: float = 0.0) -> list[Outgoing]:
        """Timers: drop waves silent past ``wave_timeout_s``, checkpoint when due; never
        raises. ``stalled_s``: how long the shard's loop itself did not run (heartbeats may be
        queued unread), which no wave's silence counts."""
        out: list[Outgoing] = []
        try:
            if stalled_s > 0:
                self.clocks.credit(stalled_s)
            timeout = self.config.job.wave_timeout_s
            # moved: the waves talk to the standby, their silence here is no news
            for wave in [] if self.moved_to else self.clocks.silent(timeout, now):
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
        """The transport saw connection ``identity`` close: its waves leave the membership at
        once (their process died or closed its client; one that is alive re-joins with its next
        request), so the others go on without waiting for the lease."""
        if self.standby is not None:
            self.standby.connection_closed(identity)
        out: list[Outgoing] = []
        for wave in self.owners.connection_closed(identity):
            if wave in self.clocks.live:
                log.info(
                    "wave %s: its connection closed; it leaves the membership", wave_name(*wave)
                )
                out += self._leave(wave, "its connection closed; register again")
        return out

    def _housekeeping(self) -> list[Outgoing]:
        """After every request and timer: complete a bulk-synchronous sum, release the pulls
        that may now read, checkpoint when due. Guarded like a request: a failure here is
        logged and answered, never the end of the shard."""
        try:
            self.updates.complete()
            out = self.parked.release(self._may_read, self._serve_parked)
        except Exception:
            log.error("internal error releasing parked pulls:\n%s", traceback.format_exc())
            out = self.parked.answer(
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
            out = self.parked.answer(lambda p: True, ErrorCode.SHUTTING_DOWN, "shutting down")
            self.datapath.close()
        return out

    # --- requests -----------------------------------------------------------------------------

    def rpc_register(self, peer: Peer, h: Header, body: RegisterRequest, tensors) -> Outgoing:
        if self.shard.initialized:
            self.shard.check_plan(h.plan)
        wave, clock = self.members.register(peer, h, body.resume, body.exact)
        self.push_parts.forget(wave)  # a push in parts before it is given again whole
        log.info("wave %s joined at clock %d", wave_name(*wave), clock)
        lost = self.checkpoints.lost_on_restore if body.resume else 0
        reply = RegisterReply(
            self.shard.version, clock, self.shard.initialized, lost, self.standby_address
        )
        return self._reply(peer, h, reply)

    def rpc_heartbeat(self, peer: Peer, h: Header, body: HeartbeatRequest, tensors) -> Outgoing:
        self.members.heartbeat(h.worker, body.waves)
        return self._reply(peer, h, Ack(self.shard.version))

    def rpc_init(self, peer, h: Header, body: InitRequest, tensors) -> Outgoing:
        seeded = self.shard.initialize(
            h.plan, h.keys, tensors, body.trainable, body.wire, body.ndims, body.version
        )
        return self._reply(peer, h, InitReply(self.shard.version, seeded))

    def rpc_pull(self, peer, h: Header, body: PullRequest, tensors) -> list[Outgoing]:
        if body.observer:
            # Evaluation and tools read the current weights; they are not a wave and never park.
            self.shard.check_plan(h.plan)
            return self._weights(
                peer,
                h.request_id,
                None,
                h.clock,
                0.0,
                part_bytes=body.part_bytes,
                master=body.master,
            )
        wave = self.members.registered(h, peer)
        self.datapath.check_pull(wave, body.shm)
        self.parked.check_room()
        return self._pull_or_park(
            peer, h.request_id, wave, h.clock, shm=body.shm, part_bytes=body.part_bytes
        )

    def rpc_push(self, peer, h: Header, body: PushRequest, tensors) -> Outgoing | None:
        if body.more:
            return self._push_part(peer, h, tensors)
        _, action = self._push(peer, h, body, tensors)
        return self._reply(peer, h, PushReply(self.shard.version, action))

    def rpc_push_pull(self, peer, h: Header, body: PushRequest, tensors) -> list[Outgoing]:
        if body.more:
            return self._push_part(peer, h, tensors)
        self.parked.check_room()  # before the push: a refused request must change nothing
        wave, action = self._push(peer, h, body, tensors)
        clock = self.clocks.clocks[wave]
        return self._pull_or_park(
            peer, h.request_id, wave, clock, action, shm=body.shm, part_bytes=body.part_bytes
        )

    def rpc_leave(self, peer: Peer, h: Header, body, tensors) -> list[Outgoing]:
        wave = self.members.registered(h, peer)
        out = self._leave(wave, "the wave left")
        log.info("wave %s left at clock %d", wave_name(*wave), self.clocks.clocks[wave])
        return [*out, self._reply(peer, h, Ack(self.shard.version))]

    def rpc_attach(self, peer: Peer, h: Header, body: AttachRequest, tensors) -> list[Outgoing]:
        wave = self.members.registered(h, peer)
        self.shard.check_plan(h.plan)
        # segments are about to change: a shared-memory pull still parked would read the old
        out = self.parked.answer(
            lambda p: p.wave == wave and p.shm,
            ErrorCode.NOT_ATTACHED,
            "the wave attached again; pull again",
        )
        reply = self.datapath.attach(wave, body, self.shard)
        self.stats[wave].transport = reply.transport
        return [*out, self._reply(peer, h, reply)]

    def rpc_stats(self, peer, h: Header, body, tensors) -> Outgoing:
        reply = StatsReply(
            version=self.shard.version,
            shard=self.config.shard_index,
            update_rule=self.updates.describe(),
            # every shard measures the waves (a slow node's shard moves by it), but the waves
            # take their batch from shard 0's replies (worker/rounds.py): only its balancer sizes
            batches=self.updates.balancer.describe() if self.config.shard_index == 0 else "",
            parked_now=len(self.parked),
            rejected=self.rejected,
            checkpoint_failures=self.checkpoints.failures,
            waves=self.members.table(),
            members=self.members.summary(),
            shm_reads=self.datapath.read_counts(),
        )
        return self._reply(peer, h, reply)

    def rpc_describe(self, peer, h: Header, body: DescribeRequest, tensors) -> Outgoing:
        """A worker that joins the running job: the job, where every shard is, and a slot."""
        self.admin.check(h.op, peer, body.token)
        if self.directory is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_OP,
                "this shard does not know where the job's other shards are (started by hand?): "
                "give the worker every shard's address with --shard instead of --join",
            )
        waves = self.config.job.waves
        rank, workers = self.members.free_slot(max(1, self.config.expect_waves // waves))
        job = dataclasses.asdict(self.config.job)
        log.info("a worker joins as worker %d", rank)
        return self._reply(peer, h, JobDescription(job, self.directory(), rank, workers))

    def rpc_checkpoint(self, peer, h: Header, body: AdminRequest, tensors) -> Outgoing:
        self.admin.check(h.op, peer, body.token)
        path = self.checkpoints.write()
        return self._reply(peer, h, CheckpointReply(self.shard.version, str(path)))

    def rpc_shutdown(self, peer, h: Header, body: AdminRequest, tensors) -> Outgoing:
        self.admin.check(h.op, peer, body.token)
        self.stopping = True
        self.shut_down_by_admin = True
        return self._reply(peer, h, Ack(self.shard.version))

    # --- membership, admin, errors ------------------------------------------------------------

    def _leave(self, wave: WaveId, why: str) -> list[Outgoing]:
        """``wave`` leaves the membership: free what the shard kept for it (segments, DC-ASGD
        copy, buffer values) and answer its parked pulls; returns those answers."""
        self.members.leave(wave, why)
        self.push_parts.forget(wave)
        self.updates.forget(wave)
        self.shard.forget_wave(wave)
        self.datapath.detach(wave)
        return self.parked.answer(lambda p: p.wave == wave, ErrorCode.NOT_REGISTERED, why)

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
        self.members.count_rejection(header, code)
        # a moved shard's answer is the protocol at work (logged once, when it moved): no alarm
        level = logging.INFO if code == ErrorCode.MOVED else logging.WARNING
        log.log(level, "rejected request %d: [%s] %s", request_id, code, message)
        return Outgoing(peer, error_header(request_id, code, message))
