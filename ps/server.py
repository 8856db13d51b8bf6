"""ShardServer: one shard's ROUTER socket and event loop.

Requests are dispatched to ``rpc_<op>`` methods. Each returns a reply, or ``None`` when it parked a
pull that the staleness bound does not allow yet; parked pulls are answered as soon as other waves'
pushes (or departures) allow them, never polled. Any refused request gets an ``error`` reply and
leaves the shard's parameters as they were; nothing a client sends can stop the loop.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from wavelet.common.config import PSConfig
from wavelet.common.protocol import (
    ErrorCode,
    Header,
    Op,
    ProtocolError,
    decode,
    error_header,
    send_message,
)
from wavelet.common.records import RecordWriter
from wavelet.common.security import ServerSecurity, check_bind
from wavelet.ps.checkpoints import checkpoint_path, read_checkpoint, write_checkpoint
from wavelet.ps.policy import make_policy
from wavelet.ps.shard import Shard
from wavelet.ps.staleness import ClockTable, StalenessBound, WaveId, WaveStats, wave_name

log = logging.getLogger("wavelet.ps")

Reply = tuple[Header, list[torch.Tensor]]
REQUEST_OPS = (
    Op.REGISTER,
    Op.INIT,
    Op.PULL,
    Op.PUSH,
    Op.PUSH_PULL,
    Op.LEAVE,
    Op.HEARTBEAT,
    Op.STATS,
    Op.CHECKPOINT,
    Op.SHUTDOWN,
)
SEND_WAIT_S = 30.0  # longest wait for ZeroMQ to release parameter memory before an update


@dataclass
class _ParkedPull:
    identity: bytes
    request_id: int
    wave: WaveId
    clock: int
    since: float
    action: str = ""  # what became of the push that came with this pull


class ShardServer:
    """Serves one shard of the parameters over a ROUTER socket bound to ``config.bind``."""

    def __init__(self, config: PSConfig, context: zmq.Context | None = None):
        self.config = config
        self.shard = Shard(config.job.optimizer)
        self.clocks = ClockTable()
        self.bound = StalenessBound(config.job.staleness)
        self.stats: dict[WaveId, WaveStats] = {}
        self.parked: list[_ParkedPull] = []
        self.rejected = 0
        # Bulk-synchronous accumulation: the sum of this clock's gradients and who sent them.
        self._sum: dict[int, torch.Tensor] | None = None
        self._sum_clock = -1
        self._sum_count = 0
        self._sum_lr = 0.0
        job = config.job
        self.policy = make_policy(job.stale_policy, job.drop_limit, job.dc_lambda)
        self._sends: list[zmq.MessageTracker] = []
        self._stopping = False
        self._handlers = {op: getattr(self, f"rpc_{op}") for op in REQUEST_OPS}
        self.push_log = None
        if config.run_dir:
            path = Path(config.run_dir) / "records" / f"ps-{config.shard_index}-pushes.jsonl"
            self.push_log = RecordWriter(path)

        self._checkpointed = (0, time.monotonic())  # version and time of the last checkpoint
        if config.run_dir:
            self._restore()

        self.context = context or zmq.Context.instance()
        check_bind(config.bind, secure=bool(config.curve_secret), insecure=config.insecure)
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
        self.socket.bind(config.bind)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if config.ready_file:
            _write_atomically(Path(config.ready_file), self.address)

    # --- the loop ---------------------------------------------------------------------------

    def serve_forever(self, poll_ms: int = 100) -> None:
        """Serve until ``stop()`` (a signal handler may call it) or a ``shutdown`` request."""
        log.info("shard %d serving on %s", self.config.shard_index, self.address)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        try:
            while not self._stopping:
                self._drop_silent_waves()
                if poller.poll(poll_ms):
                    # Drain what is queued before polling again.
                    while not self._stopping:
                        try:
                            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.handle(frames)
        finally:
            self.close()

    def stop(self) -> None:
        self._stopping = True

    def _drop_silent_waves(self) -> None:
        for wave in self.clocks.silent(self.config.job.wave_timeout_s):
            log.warning(
                "wave %s silent for over %.0fs: dropped from the membership so the "
                "others go on; it rejoins when it comes back",
                wave_name(wave),
                self.config.job.wave_timeout_s,
            )
            self.clocks.leave(wave)
            self.policy.forget(wave)
        self._maybe_apply_sum()
        self._release_parked()

    def close(self) -> None:
        if self.config.run_dir and self.shard.initialized:
            try:
                self.write_checkpoint()
            except OSError as e:
                log.error("final checkpoint failed: %s", e)
        for p in self.parked:
            self._send_error(
                p.identity, p.request_id, ErrorCode.SHUTTING_DOWN, "shard is shutting down"
            )
        self.parked.clear()
        self.socket.close(linger=500)
        if self.security:
            self.security.stop()
        if self.push_log:
            self.push_log.close()
        log.info("shard %d stopped at version %d", self.config.shard_index, self.shard.version)

    def handle(self, frames: list[zmq.Frame]) -> None:
        """Answer one request (routing frame first); never raises."""
        identity = frames[0].bytes
        request_id = 0
        try:
            header, tensors = decode(frames[1:])
            request_id = header.request_id
            handler = self._handlers.get(header.op)
            if handler is None:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_OP,
                    f"unknown op {header.op!r}; known: " + ", ".join(str(o) for o in REQUEST_OPS),
                )
            reply = handler(identity, header, tensors)
        except ProtocolError as e:
            self._reject(identity, request_id, e.code, e.message, frames)
            return
        except Exception as e:  # a bug, not the client's fault: say so and keep serving
            log.error("internal error:\n%s", traceback.format_exc())
            self._reject(
                identity, request_id, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", frames
            )
            return
        if reply is not None:
            self._send(identity, *reply)
        self._release_parked()
        self._maybe_checkpoint()

    # --- requests -----------------------------------------------------------------------------

    def rpc_register(self, identity: bytes, h: Header, tensors: list[torch.Tensor]) -> Reply:
        wave = self._wave_of(h)
        if self.shard.initialized:
            self.shard.check_plan(h.plan)
        if h.body.get("resume") is True and wave in self.clocks.clocks:
            clock = self.clocks.clocks[wave]  # a resumed job goes on where it stopped
        elif h.body.get("exact") is True:
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
        log.info("wave %s joined at clock %d", wave_name(wave), clock)
        return self._ok(h, clock=clock, initialized=self.shard.initialized)

    def rpc_heartbeat(self, identity: bytes, h: Header, tensors: list[torch.Tensor]) -> Reply:
        waves = h.body.get("waves")
        if not isinstance(waves, list) or not all(isinstance(w, int) for w in waves):
            raise ProtocolError(ErrorCode.MALFORMED, "heartbeat needs body.waves: wave indices")
        for index in waves:
            if (h.worker, index) in self.clocks.live:
                self.clocks.seen((h.worker, index))
        return self._ok(h)

    def rpc_init(self, identity: bytes, h: Header, tensors: list[torch.Tensor]) -> Reply:
        trainable = h.body.get("trainable")
        if not isinstance(trainable, list) or not all(isinstance(t, bool) for t in trainable):
            raise ProtocolError(ErrorCode.MALFORMED, "init needs body.trainable: a list of bools")
        seeded = self.shard.initialize(h.plan, h.keys, tensors, trainable)
        return self._ok(h, seeded=seeded)

    def rpc_pull(self, identity: bytes, h: Header, tensors: list[torch.Tensor]) -> Reply | None:
        if h.body.get("observer") is True:
            # Evaluation and tools read the current weights; they are not a wave and never park.
            self.shard.check_plan(h.plan)
            return self._weights(h.request_id, None, h.clock, parked_s=0.0)
        wave = self._registered(h)
        self._check_park_room()
        return self._pull_or_park(identity, h.request_id, wave, h.clock)

    def rpc_push(self, identity: bytes, h: Header, tensors: list[torch.Tensor]) -> Reply:
        _, action = self._push(h, tensors)
        return self._ok(h, action=action)

    def rpc_push_pull(
        self, identity: bytes, h: Header, tensors: list[torch.Tensor]
    ) -> Reply | None:
        self._check_park_room()  # before the push: a refused request must change nothing
        wave, action = self._push(h, tensors)
        return self._pull_or_park(identity, h.request_id, wave, self.clocks.clocks[wave], action)

    def rpc_leave(self, identity: bytes, h: Header, tensors: list[torch.Tensor]) -> Reply:
        wave = self._registered(h)
        self.clocks.leave(wave)
        self.policy.forget(wave)
        log.info("wave %s left at clock %d", wave_name(wave), self.clocks.clocks[wave])
        self._maybe_apply_sum()
        return self._ok(h)

    def rpc_stats(self, identity: bytes, h: Header, tensors: list[torch.Tensor]) -> Reply:
        waves = {}
        for wave, st in self.stats.items():
            waves[wave_name(wave)] = {
                "clock": self.clocks.clocks.get(wave, 0),
                "live": wave in self.clocks.live,
                **st.summary(),
            }
        return self._ok(
            h,
            shard=self.config.shard_index,
            version=self.shard.version,
            staleness_bound=str(self.bound.s),
            parked_now=len(self.parked),
            rejected=self.rejected,
            waves=waves,
        )

    def rpc_checkpoint(self, identity: bytes, h: Header, tensors: list[torch.Tensor]) -> Reply:
        path = self.write_checkpoint()
        return self._ok(h, path=str(path))

    def rpc_shutdown(self, identity: bytes, h: Header, tensors: list[torch.Tensor]) -> Reply:
        self.stop()
        return self._ok(h)

    # --- pushes and pulls ---------------------------------------------------------------------

    def _push(self, h: Header, tensors: list[torch.Tensor]) -> tuple[WaveId, str]:
        """Validate a push completely, then apply or accumulate it."""
        wave = self._registered(h)
        shard = self.shard
        shard.check_plan(h.plan)
        clock = self.clocks.clocks[wave]
        if h.clock != clock:
            raise ProtocolError(
                ErrorCode.STALE_CLOCK,
                f"push for clock {h.clock}, but wave {wave_name(wave)} is at "
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
                ErrorCode.NOT_REGISTERED, f"wave {wave_name(wave)} left; register again to push"
            )
        if self.bound.synchronous and self._sum is not None and clock != self._sum_clock:
            raise ProtocolError(
                ErrorCode.STALE_CLOCK,
                f"bulk-synchronous clock {self._sum_clock} is still open; "
                f"pull before pushing clock {clock}",
            )
        shard.check_push(h.keys, tensors)
        lr_scale = _lr_scale(h)

        tau = shard.version - h.read_version
        grads = shard.gradients(tensors)
        self._wait_sends()
        shard.store_buffers(wave, tensors)
        if self.bound.synchronous:
            # Every gradient of the open clock read the same version (tau = 0): average them.
            if self._sum is None:
                self._sum = {k: g.clone() for k, g in grads.items()}
                self._sum_clock, self._sum_count, self._sum_lr = clock, 1, lr_scale
            else:
                for k, g in grads.items():
                    self._sum[k].add_(g)
                self._sum_count += 1
                self._sum_lr += lr_scale
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
        if self.push_log:
            self.push_log.write(
                {
                    "t": time.time(),
                    "worker": wave[0],
                    "wave": wave[1],
                    "clock": clock,
                    "read_version": h.read_version,
                    "version": shard.version,
                    "staleness": tau,
                    "action": action,
                    "lr_scale": lr_scale,
                    "policy": self.policy.name,
                }
            )
        self._maybe_apply_sum()
        return wave, action

    def _maybe_apply_sum(self) -> None:
        """Bulk-synchronous: apply the mean once every live wave has pushed the open clock."""
        if self._sum is None:
            return
        slowest = self.clocks.min_live_clock()
        if slowest is not None and slowest <= self._sum_clock:
            return
        grads = {k: s.div_(self._sum_count) for k, s in self._sum.items()}
        self._wait_sends()
        self.shard.apply(grads, self._sum_lr / self._sum_count)
        self._sum, self._sum_count, self._sum_lr = None, 0, 0.0

    def _pull_or_park(
        self, identity: bytes, request_id: int, wave: WaveId, clock: int, action: str = ""
    ) -> Reply | None:
        if self._may_read(clock):
            return self._weights(request_id, wave, clock, 0.0, action)
        self.parked.append(_ParkedPull(identity, request_id, wave, clock, time.monotonic(), action))
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
        if self.bound.synchronous and self._sum is not None and clock > self._sum_clock:
            return False
        return self.bound.may_read(clock, self.clocks)

    def _release_parked(self) -> None:
        if not self.parked:
            return
        still = []
        for p in self.parked:
            if self._may_read(p.clock):
                waited = time.monotonic() - p.since
                self.stats[p.wave].parked_s += waited
                reply = self._weights(p.request_id, p.wave, p.clock, waited, p.action)
                self._send(p.identity, *reply)
            else:
                still.append(p)
        self.parked = still

    def _weights(
        self, request_id: int, wave: WaveId | None, clock: int, parked_s: float, action: str = ""
    ) -> Reply:
        slowest = self.clocks.min_live_clock()
        body = {
            "version": self.shard.version,
            "clock": clock,
            "parked_s": parked_s,
            "slowest_clock": -1 if slowest is None else slowest,
        }
        if action:
            body["action"] = action  # what became of the push this pull came with
        if wave is not None:
            self.stats[wave].record_read(clock, self.shard.version)
            if not self.bound.synchronous:
                self.policy.on_read(wave, self.shard.params)
        h = Header(op=Op.REPLY, request_id=request_id, keys=self.shard.keys, body=body)
        return h, self.shard.values()

    # --- helpers ------------------------------------------------------------------------------

    def _wave_of(self, h: Header) -> WaveId:
        if not h.worker or h.wave < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "request needs worker and wave (>= 0)")
        return (h.worker, h.wave)

    def _registered(self, h: Header) -> WaveId:
        wave = self._wave_of(h)
        if wave not in self.clocks.clocks:
            raise ProtocolError(
                ErrorCode.NOT_REGISTERED,
                f"wave {wave_name(wave)} has not registered with this shard",
            )
        if wave in self.clocks.live:
            self.clocks.seen(wave)  # any request is a sign of life
        return wave

    def _ok(self, h: Header, **body) -> Reply:
        body.setdefault("version", self.shard.version)
        return Header(op=Op.REPLY, request_id=h.request_id, body=body), []

    def _send(self, identity: bytes, header: Header, tensors: list[torch.Tensor]) -> None:
        tracker = send_message(self.socket, header, tensors, prefix=[identity], track=True)
        if tracker is not None:
            self._sends.append(tracker)

    def _wait_sends(self) -> None:
        """Parameters go out zero-copy: wait until ZeroMQ has released them before changing them."""
        for t in self._sends:
            try:
                t.wait(SEND_WAIT_S)
            except zmq.NotDone:
                log.warning("a reply took over %.0fs to send; updating anyway", SEND_WAIT_S)
        self._sends.clear()

    def _reject(
        self,
        identity: bytes,
        request_id: int,
        code: ErrorCode,
        message: str,
        frames: list[zmq.Frame],
    ) -> None:
        self.rejected += 1
        try:  # count it against the wave, when the header is readable enough to name one
            wave = self._wave_of(Header.unpack(frames[1].bytes))
        except (ProtocolError, IndexError):
            wave = None
        if wave in self.stats:
            self.stats[wave].rejected[str(code)] += 1
        log.warning("rejected request %d: [%s] %s", request_id, code, message)
        self._send_error(identity, request_id, code, message)

    def _send_error(self, identity: bytes, request_id: int, code: ErrorCode, message: str) -> None:
        send_message(self.socket, error_header(request_id, code, message), prefix=[identity])

    def write_checkpoint(self) -> Path:
        """Parameters, optimizer state, version and clocks (an open bulk-synchronous sum is not
        an applied update and is not saved)."""
        if not self.config.run_dir:
            raise ProtocolError(ErrorCode.MALFORMED, "this shard was started without a run dir")
        if not self.shard.initialized:
            raise ProtocolError(ErrorCode.NOT_INITIALIZED, "nothing to checkpoint yet")
        self._wait_sends()
        state = self.shard.state_dict()
        state["clocks"] = [[w[0], w[1], c] for w, c in self.clocks.clocks.items()]
        path = checkpoint_path(self.config.run_dir, self.config.shard_index)
        write_checkpoint(path, state)
        self._checkpointed = (self.shard.version, time.monotonic())
        return path

    def _maybe_checkpoint(self) -> None:
        cfg = self.config
        if not (cfg.run_dir and self.shard.initialized):
            return
        version, when = self._checkpointed
        due_updates = cfg.checkpoint_every and self.shard.version - version >= cfg.checkpoint_every
        due_time = cfg.checkpoint_every_s and time.monotonic() - when >= cfg.checkpoint_every_s
        if (due_updates or due_time) and self.shard.version != version:
            self.write_checkpoint()

    def _restore(self) -> None:
        state = read_checkpoint(checkpoint_path(self.config.run_dir, self.config.shard_index))
        if state is None:
            return
        self.shard.load_state_dict(state)
        for worker, wave, clock in state["clocks"]:
            self.clocks.join((worker, wave), clock)
            self.stats.setdefault((worker, wave), WaveStats())
        self._checkpointed = (self.shard.version, time.monotonic())
        log.warning(
            "shard %d restored version %d from its checkpoint",
            self.config.shard_index,
            self.shard.version,
        )


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _lr_scale(h: Header) -> float:
    """The learning-rate factor a push carries (the job's schedule); 1 when absent."""
    scale = h.body.get("lr_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0.0 <= scale <= 1.0:
        raise ProtocolError(
            ErrorCode.MALFORMED, f"lr_scale must be a number in [0, 1], got {scale!r}"
        )
    return float(scale)
