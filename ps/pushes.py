"""A shard's pushes and reads: a push validated whole and then applied (or summed), a read
served now or parked until the staleness bound or the turn order lets it; and a standby's part:
its primary's seeds and updates, the take-over, the clocks a copy stands for.

The parts of ``ShardService`` (``ps/service.py``) that decide what a push and a read mean; the
service dispatches requests to them, the data path moves the bytes.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from wavelet.common.messages import PushRequest, ReplicaUpdate, Seed, WeightsReply, reply_header
from wavelet.common.protocol import ErrorCode, Header, ProtocolError, wave_name
from wavelet.ps.datapath import Outgoing
from wavelet.ps.owners import Peer
from wavelet.ps.parked import ParkedPull
from wavelet.ps.staleness import WaveId
from wavelet.ps.standby import StandbyRole


class PushesAndReads:
    """Mixed into ``ShardService``: its pushes, reads and standby requests."""

    # --- pushes and pulls ---------------------------------------------------------------------

    def _push(
        self, peer: Peer, h: Header, body: PushRequest, tensors: list[torch.Tensor]
    ) -> tuple[WaveId, str]:
        """Validate a push completely, then apply or accumulate it, then record it."""
        started = time.perf_counter()
        wave = self.members.registered(h, peer)
        self.datapath.done_reading(wave)  # a wave's next request: it has read its last weights
        keys, tensors = self.push_parts.whole(wave, h.clock, list(h.keys), list(tensors))
        h = dataclasses.replace(h, keys=keys)
        self.shard.check_plan(h.plan)
        clock = self.clocks.clocks[wave]
        self._check_push_order(wave, clock, h)
        tau = self.shard.version - h.read_version
        if body.skip:
            if tensors:
                raise ProtocolError(ErrorCode.MALFORMED, "a skipped step carries no tensors")
            action, lr_scale = self.updates.skip(wave, clock, self.stats[wave]), 0.0
        else:
            tensors = self.datapath.gradients(wave, body.shm, tensors)
            self.shard.check_push(h.keys, tensors)  # frames or a segment: validated alike
            self.shard.check_absent(body.absent)
            action, lr_scale = self.updates.push(wave, clock, tau, tensors, body, self.stats[wave])
            self.stats[wave].record_push(tau)
        self.clocks.advance(wave)
        self.checkpoints.log_push(
            wave_name=wave_name(*wave),
            worker=wave[0],
            wave=wave[1],
            clock=clock,
            read_version=h.read_version,
            version=self.shard.version,
            staleness=tau,
            action=action,
            lr_scale=lr_scale,
            policy=self.updates.policy.name,
            apply_s=time.perf_counter() - started,  # this shard's work: read, check, update
            # what the wave told of its step (balanced batches weigh it): its batch, and how
            # long it computed which batch
            samples=body.samples,
            compute_s=body.compute_s,
            compute_samples=body.compute_samples,
        )
        self.updates.complete()
        return wave, action

    def _push_part(self, peer: Peer, h: Header, tensors: list[torch.Tensor]) -> None:
        """Keep a part of a push over TCP (ps/push_parts.py); never answered: a part of a wave
        that is not registered is dropped, and its last part is refused as the push is."""
        try:
            wave = self.members.registered(h, peer)
        except ProtocolError:
            return
        self.push_parts.add(wave, h.clock, list(h.keys), list(tensors))

    def _check_push_order(self, wave: WaveId, clock: int, h: Header) -> None:
        """Each clock is pushed once, in order, by a live wave, from a version this shard had."""
        if h.clock != clock:
            raise ProtocolError(
                ErrorCode.STALE_CLOCK,
                f"push for clock {h.clock}, but wave {wave_name(*wave)} is at "
                f"clock {clock}; each clock is pushed once, in order",
            )
        if h.read_version < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "push needs the version it read (read >= 0)")
        if h.read_version > self.shard.version:
            raise ProtocolError(
                ErrorCode.FUTURE_VERSION,
                f"read version {h.read_version} is newer than this shard's version "
                f"{self.shard.version}",
            )
        if wave not in self.clocks.live:
            raise ProtocolError(
                ErrorCode.NOT_REGISTERED, f"wave {wave_name(*wave)} left; register again to push"
            )
        self.updates.check_push(wave, clock)

    def _pull_or_park(
        self,
        peer: Peer,
        request_id: int,
        wave: WaveId,
        clock: int,
        action: str = "",
        shm: bool = False,
        part_bytes: int = 0,
    ) -> list[Outgoing]:
        self.datapath.done_reading(wave)  # parked or not, it has read its last weights
        if self._may_read(wave, clock):
            return self._weights(peer, request_id, wave, clock, 0.0, action, shm, part_bytes)
        self.parked.park(peer.identity, request_id, wave, clock, action, shm, part_bytes)
        self.stats[wave].parked += 1
        return []

    def _may_read(self, wave: WaveId, clock: int) -> bool:
        if not self.shard.initialized:
            return False
        if not self.barrier_passed:
            if len(self.clocks.clocks) < self.config.expect_waves:
                return False  # start barrier: wait for the whole job to register
            self.barrier_passed = True
        return self.updates.may_read(wave, clock)

    def _serve_parked(self, p: ParkedPull, waited: float) -> list[Outgoing]:
        self.stats[p.wave].parked_s += waited
        try:
            return self._weights(
                p.peer, p.request_id, p.wave, p.clock, waited, p.action, p.shm, p.part_bytes
            )
        except ProtocolError as e:  # e.g. its segments are gone: this pull alone fails
            return [self._reject(p.peer, p.request_id, e.code, e.message, None)]

    def _weights(
        self,
        peer: Peer | bytes,
        request_id: int,
        wave: WaveId | None,
        clock: int,
        parked_s: float,
        action: str = "",
        shm: bool = False,
        part_bytes: int = 0,
        master: bool = False,
    ) -> list[Outgoing]:
        slowest = self.clocks.min_live_clock()
        body = WeightsReply(
            version=self.shard.version,
            clock=clock,
            parked_s=parked_s,
            slowest_clock=-1 if slowest is None else slowest,
            action=action,
            shm=shm,
            batch=self.updates.batch_for(wave) if wave is not None else 0,
        )
        if wave is not None:
            self.stats[wave].record_read(clock, self.shard.version)
            self.updates.on_read(wave)
        header = reply_header(request_id, body)
        header.keys = self.shard.keys
        peer = peer.identity if isinstance(peer, Peer) else peer
        # into a shared-memory segment the copy casts on its way (one pass, no 16-bit copy)
        values = self.shard.values() if master or shm else self.shard.wire_values()
        return self.datapath.weights_reply(peer, header, values, wave, shm, part_bytes)

    # --- a standby's requests ---------------------------------------------------------------

    def rpc_seed(self, peer: Peer, h: Header, body: Seed, tensors) -> Outgoing:
        return self._reply(peer, h, self._standby_role().seed(peer, h, body, tensors))

    def rpc_replicate(self, peer: Peer, h: Header, body: ReplicaUpdate, tensors) -> Outgoing:
        return self._reply(peer, h, self._standby_role().replicate(peer, h, body, tensors))

    def _standby_role(self) -> StandbyRole:
        if self.standby is None:
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED, f"shard {self.config.shard_index} is nobody's standby"
            )
        return self.standby

    def took_over(self, clocks: list[list], lease_s: float) -> None:
        """This standby serves its shard from now on: it checkpoints and records pushes, waits
        for no start barrier, and knows the waves' clocks from the primary (each live wave has
        ``lease_s`` to register here before it stops counting); with no state from the primary
        it takes the newest checkpoint it can read, else the first wave seeds it."""
        self.checkpoints.enabled = True
        self.barrier_passed = True
        self.members.restore_clocks(clocks, lease_s, self.config.job.wave_timeout_s)
        if not self.shard.initialized:
            for wave, clock in self.checkpoints.restore():
                self.members.restore(wave, clock)

    def replicated_clocks(self, committed: bool = True) -> list[list]:
        """[worker, wave, clock, live] per wave. ``committed``: the clock its pushes reached in
        applied updates: a push still in an open synchronous sum is not counted, so after a
        take-over the standby asks for it again (it dies with the primary's open sum); a
        hand-over, which passes the open sums on, counts them."""
        clocks = self.clocks.clocks
        if committed:
            clocks = self.updates.committed_clocks(clocks)
        return [[w[0], w[1], c, w in self.clocks.live] for w, c in clocks.items()]
