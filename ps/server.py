"""ShardServer: one shard daemon's loop over its endpoints, and its standby duties.

Everything about what a request means lives in ``ShardService`` (``ps/service.py``); an
``Endpoint`` (``ps/endpoint.py``) receives a socket's frames, hands them over and sends what
comes back. The daemon has one endpoint for its own shard and, with ``standby_bind``, one for the
standby it hosts of the previous shard; both are served by this one loop (no thread, no lock).
Where its own shard has a standby (``standby_address``), a ``Replicator`` keeps it seeded, and
with ``shard_replicas = 2`` in step, update by update (``ps/replication.py``); a stopping shard
hands itself over to it before it exits (docs/faults.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import zmq

from wavelet.common.daemon_config import PSConfig
from wavelet.common.protocol import ErrorCode
from wavelet.common.records import write_text_whole
from wavelet.common.security import (
    ServerSecurity,
    check_bind,
    load_admin_token,
    public_key_z85,
)
from wavelet.ps.endpoint import BindError, Endpoint
from wavelet.ps.replication import Replicator
from wavelet.ps.service import ShardService
from wavelet.ps.standby import StandbyRole

__all__ = ["BindError", "ShardServer"]

log = logging.getLogger(__name__)

TICK_S = 0.1  # how often timers run, however busy the sockets are
STALL_S = 0.5  # timers this late mean the loop did not run: waves' silence does not count it
STANDBY_ADDRESS_WAIT_S = 120.0  # for the standby's host to write its address
GOODBYES_S = 0.3  # a shard handing itself over first takes the leaves already on their way


class ShardServer:
    """Serves one shard (and maybe another's standby) over ROUTER sockets."""

    def __init__(self, config: PSConfig, context: zmq.Context | None = None):
        self.config = config
        check_bind(config.bind, secure=bool(config.curve_secret), insecure=config.insecure)
        self.context = context or zmq.Context.instance()
        self.security = None
        if config.curve_secret:
            self.security = ServerSecurity(
                self.context, config.curve_secret, config.curve_authorized
            )
        token = load_admin_token(config.admin_token_path) if config.admin_token_path else ""
        self.token = token
        admin_key = public_key_z85(config.curve_admin_key) if config.curve_admin_key else ""
        self.endpoints: list[Endpoint] = []
        self.replicator: Replicator | None = None
        self.handed_over = False
        try:
            self.primary = self._endpoint(config, token, admin_key)
            self.hosted = None
            if config.standby_bind:
                hosted = dataclasses.replace(
                    config,
                    shard_index=config.stands_by_for,
                    bind=config.standby_bind,
                    standby_role=True,
                    standby_bind="",
                    standby_address="",
                    standby_address_file="",
                    ready_file="",
                    metrics_port=-1,
                )
                self.hosted = self._endpoint(hosted, token, admin_key)
                self.hosted.service.standby = StandbyRole(
                    self.hosted.service, config.job.shard_timeout_s, self._took_over
                )
        except BaseException:
            self._close_endpoints()
            raise
        self.service = self.primary.service
        self.address = self.primary.address
        if config.job_address_files:
            self.set_directory(lambda: [_read(f) for f in config.job_address_files])

    def _endpoint(self, config: PSConfig, token: str, admin_key: str) -> Endpoint:
        endpoint = Endpoint(
            self.context,
            config.bind,
            config.max_message_mib,
            config.job.shard_timeout_s,
            self.security,
        )
        self.endpoints.append(endpoint)
        endpoint.service = ShardService(
            config, token, weights_in_use=endpoint.weights_in_flight, admin_key=admin_key
        )
        return endpoint

    @property
    def shard(self):
        return self.service.shard

    @property
    def bytes_in(self) -> int:
        return sum(e.bytes_in for e in self.endpoints)

    @property
    def bytes_out(self) -> int:
        return sum(e.bytes_out for e in self.endpoints)

    # --- the loop ---------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until ``stop()`` (a signal handler may call it) or a ``shutdown`` request.
        The ready files are written here, once everything the daemon starts with (its metrics
        endpoint too) is up, so a launcher never takes a shard that is about to fail for ready."""
        cfg = self.config
        log.info("shard %d serving on %s", cfg.shard_index, self.address)
        if self.hosted is not None:
            log.info("standby of shard %d listening on %s", cfg.stands_by_for, self.hosted.address)
            if cfg.standby_ready_file:
                _write_ready(Path(cfg.standby_ready_file), self.hosted.address)
        poller = zmq.Poller()
        for e in self.endpoints:
            poller.register(e.socket, zmq.POLLIN)
        # this shard's own standby is known before any wave is told where it is (ready)
        if self._standby_address():
            self._start_replicator(poller)
        if cfg.ready_file:
            _write_ready(Path(cfg.ready_file), self.address)
        next_tick = time.monotonic() + TICK_S
        try:
            while not self.stopping:
                wait_ms = max(0.0, next_tick - time.monotonic()) * 1000
                if poller.poll(wait_ms):
                    self._replicate()
                    # Drain what is queued, but run the timers on time even if it never empties.
                    for e in self.endpoints:
                        e.new_turn()
                    busy = True
                    while busy and not self.stopping and time.monotonic() < next_tick:
                        busy = False
                        for e in self.endpoints:
                            busy = e.serve_one() or busy
                            self._replicate()
                now = time.monotonic()
                if now >= next_tick:
                    stalled = self._stalled(now - next_tick)
                    for e in self.endpoints:
                        e.send_all(e.service.tick(stalled_s=stalled))
                    self._replicate()
                    self._maybe_move()
                    next_tick = time.monotonic() + TICK_S
        finally:
            self.close()

    def stop(self) -> None:
        for e in self.endpoints:
            e.service.stopping = True

    @property
    def stopping(self) -> bool:
        """Stopped (a signal, a caller), or shut down by the job on every shard it serves: its
        own, and the one its standby took over (each is shut down at its own address)."""
        serving = [self.primary]
        if self.hosted is not None and self.hosted.service.standby.promoted:
            serving.append(self.hosted)
        return all(e.service.stopping for e in serving)

    def set_directory(self, directory) -> None:
        """Where every shard of the job is (a callable): joining workers are told."""
        for e in self.endpoints:
            e.service.directory = directory

    def set_standby_address(self, address: str) -> None:
        """Where this shard's own standby listens, learned after start (torchrun's store)."""
        self.config = dataclasses.replace(self.config, standby_address=address)

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

    # --- standbys -----------------------------------------------------------------------------

    def _standby_address(self) -> str:
        """Where this shard's standby listens: given, or written by its host to a file (waited
        for while its host starts); "" where it has none."""
        cfg = self.config
        if cfg.standby_address or not cfg.standby_address_file:
            return cfg.standby_address
        path = Path(cfg.standby_address_file)
        deadline = time.monotonic() + STANDBY_ADDRESS_WAIT_S
        while not path.exists():
            if self.service.stopping or time.monotonic() > deadline:
                log.error(
                    "shard %d: no standby address in %s after %.0f s; going on without one",
                    cfg.shard_index,
                    path,
                    STANDBY_ADDRESS_WAIT_S,
                )
                return ""
            time.sleep(0.05)
        return path.read_text().strip()

    def _start_replicator(self, poller: zmq.Poller) -> None:
        address = self._standby_address()
        job = self.config.job
        self.replicator = Replicator(
            self.context,
            address,
            self.config.shard_index,
            self.token,
            mirror=job.shard_replicas == 2,
            keys=self._admin_keys(),
            lost_after_s=job.shard_timeout_s,
        )
        self.service.standby_address = address
        # a reply waits while an update it may show is not yet with the standby (still to be
        # sent, or not acknowledged)
        self.primary.in_step = lambda: not self._pending and self.replicator.in_step
        self.service.shard.on_apply = self._applied
        self._pending: list = []
        poller.register(self.replicator.socket, zmq.POLLIN)
        log.info("shard %d: its standby is at %s", self.config.shard_index, address)

    def _admin_keys(self):
        """With CURVE, the admin client's keys (the job's keys folder): only they may seed a
        standby; without, the admin token in each message is the proof."""
        cfg = self.config
        if not cfg.curve_admin_key:
            return None
        from wavelet.common.security import ClientKeys

        # the job's keys (wavelet keys --job): NAME.key beside NAME.key_secret
        secret = Path(cfg.curve_admin_key).with_suffix(".key_secret")
        return ClientKeys.load(str(secret), str(Path(cfg.curve_secret).with_suffix(".key")))

    def _applied(self, grads, lr_scale: float) -> None:
        self._pending.append((grads, lr_scale, self.service.shard.version))

    def _replicate(self) -> None:
        """Updates applied since the last call go to the standby (with the clocks they leave),
        its acknowledgements come in, and replies that waited for them go out."""
        r = self.replicator
        if r is None:
            return
        for grads, lr_scale, version in self._pending:
            r.replicate(self.service, grads, lr_scale, version)
        self._pending.clear()
        r.poll(self.service)
        if r.superseded and not self.handed_over:
            log.warning(
                "shard %d: its standby at %s took it over while this process was stopped or "
                "cut off; this shard serves nobody now and sends its waves there",
                self.config.shard_index,
                r.address,
            )
            self.service.checkpoints.log_membership(
                "superseded", ("shard", self.config.shard_index), f"its standby at {r.address}"
            )
            self._serve_nobody(r.address, held=True)
            return
        self.primary.release_held()

    def _took_over(self) -> None:
        """The hosted standby took its shard over: where its address is looked up, it is now."""
        cfg = self.config
        if cfg.standby_takeover_file:
            _write_ready(Path(cfg.standby_takeover_file), self.hosted.address)
        if self.on_takeover is not None:
            self.on_takeover(cfg.stands_by_for, self.hosted.address)
        if self.placement is not None:
            self.placement.hosted_shard_taken_over()

    on_takeover = None  # a callback (shard index, address): wavelet run publishes it

    placement = None  # a SpeedPlacement: whether this shard should move off its node

    def _maybe_move(self) -> None:
        """A shard on a node measured slow moves to its standby on a faster one, live."""
        if self.placement is None or self.handed_over or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + 1.0
        if self.placement.due():
            log.warning("shard %d: %s", self.config.shard_index, self.placement.why)
            self.service.checkpoints.log_membership(
                "move", ("shard", self.config.shard_index), self.placement.why
            )
            self._hand_over()

    _next_look = 0.0

    def _hand_over(self) -> None:
        """The shard gives its state to its standby, which takes the shard over (it is stopping,
        or its node is slow); the waves that ask meanwhile are told where it went (``moved``)."""
        r = self.replicator
        if r is None or self.handed_over or self.service.standby is not None:
            return
        # the goodbyes of a preempted node's workers come with the shard's own stop: take them
        # first, so that the standby does not wait for waves that left
        deadline = time.monotonic() + GOODBYES_S
        while time.monotonic() < deadline:
            if not self.primary.serve_one():
                time.sleep(0.01)
        self._replicate()
        if r.hand_over(self.service):
            if r.superseded:  # it had taken the shard over already: nothing of ours to keep
                self._serve_nobody(r.address, held=True)
                return
            # the state handed over is on disk too (a group torchrun restarts resumes from it,
            # should the standby stop with it); then the checkpoints are the standby's
            self.service.checkpoints.maybe_final()
            self._serve_nobody(r.address, held=False)
            log.info(
                "shard %d handed itself to its standby at %s (version %d)",
                self.config.shard_index,
                r.address,
                self.service.shard.version,
            )
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline and self.primary.serve_one():
                pass
        else:
            log.warning(
                "shard %d could not hand itself over: its standby at %s does not answer",
                self.config.shard_index,
                r.address,
            )

    def _serve_nobody(self, address: str, held: bool) -> None:
        """The shard is its standby's at ``address`` now: every wave that asks here is sent
        there (``moved``), what is parked at once, and the checkpoints are the standby's.
        ``held``: replies waiting for the standby's ack are sent there too (the updates they
        show are not the standby's: the waves give them again)."""
        self.handed_over = True
        self.service.moved_to = address
        self.service.checkpoints.enabled = False
        message = f"the shard moved to {address}"
        if held:
            self.primary.refuse_held(ErrorCode.MOVED, message)
        self.primary.send_all(self.service.parked.answer(lambda p: True, ErrorCode.MOVED, message))

    def close(self) -> None:
        try:
            if not self.service.shut_down_by_admin:
                self._hand_over()
        except Exception:
            log.exception("handing the shard over failed")
        try:
            for e in self.endpoints:
                e.send_all(e.service.close())
        finally:
            self._close_endpoints()
        log.info(
            "shard %d stopped at version %d", self.config.shard_index, self.service.shard.version
        )

    def _close_endpoints(self) -> None:
        if self.replicator is not None:
            self.replicator.close()
        for e in self.endpoints:
            e.close()
        if self.security:
            self.security.stop()


def _read(path: str) -> str:
    return Path(path).read_text().strip()


def _write_ready(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_whole(path, text, sync=False)  # in the serving loop: no wait for the disk
