"""A wave's recovery when a shard goes away: it re-joins a shard that restarted (counting the
updates it lost), follows a shard to its standby when its primary is lost or hands itself over
(docs/faults.md), and gives up with one line naming the shard when nothing took it over.

Mixed into ``PSClient`` (``worker/client.py``), whose sockets and requests it uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from wavelet.common.messages import RegisterRequest, reply_body
from wavelet.common.protocol import ErrorCode, Header, Op, RemoteError, ShardLost
from wavelet.worker.rounds import StopRequested

log = logging.getLogger(__name__)


class Recovery:
    """``PSClient``'s part that brings a lost or restarted shard back into a wave's round."""

    def _lost(self, i: int, why: str = "") -> ShardLost:
        """The error that ends a wave whose shard ``i`` is gone for good."""
        chunks = self.chunks[i]
        mb = sum(c.numel * self.data.tensors[c.name].element_size() for c in chunks) / 1e6
        standby = self.links[i].standby
        why = why or (
            f"its standby at {standby} did not take it over"
            if standby
            else "it has no standby (--shard-replicas 2 keeps a copy on another node)"
        )
        return ShardLost(
            f"shard {i} at {self.addresses[i]} is gone: no connection for "
            f"{self.links.down_for(i):.0f} s (shard_timeout_s {self.links.lost_after_s:g}); it "
            f"held {len(chunks)} chunk(s) of the model ({mb:.1f} MB) and {why}: the job cannot "
            "go on without them",
            [self.addresses[i]],
        )

    def _fail_over(self, i: int, recover, handed: bool = False) -> tuple[Header, list]:
        """Shard ``i``'s connection is down (or it said it moved): go to its standby, which takes
        the shard over once it too has lost the primary, and re-join there; the re-join's answer
        stands in for shard i's reply. Raises ``ShardLost`` when the standby does not take over
        within the lost time."""
        link = self.links[i]
        primary, standby, since = link.address, link.standby, link.down_since
        log.warning(
            "shard %d at %s %s: wave %s/%d moves to its standby at %s",
            i,
            primary,
            "handed itself over" if handed else "lost its connection",
            self.worker,
            self.wave,
            standby,
        )
        self.links.move(i, standby)
        self.links[i].down_since = since  # the lost time counts from the first trouble
        if self.on_move is not None:
            self.on_move(i, standby)
        self.data.use_tcp(i)  # another host, maybe: attach decides again
        while True:
            try:
                return recover(i)
            except RemoteError as e:
                if e.code != ErrorCode.NOT_PRIMARY:
                    raise
            waited = time.monotonic() - (since or time.monotonic())
            if waited > self.links.lost_after_s:
                raise self._lost(i, f"its standby at {standby} says the primary is alive")
            if self.stop.wait(0.2):
                raise StopRequested()

    def _rejoin(self, i: int, recover) -> tuple[Header, list[torch.Tensor]]:
        # The reconnection that brought us here was reported before its first reply came: take
        # it in now, so that it does not trigger a second re-join at the next request.
        self._watch_connections(block_ms=0)
        self.links[i].restarted = False
        log.warning(
            "shard %s reconnected: wave %s/%d registers again",
            self.addresses[i],
            self.worker,
            self.wave,
        )
        return recover(i)

    def _recover(
        self, i: int, clock: int, repush: Callable[[], tuple[Header, list]] | None = None
    ) -> tuple[Header, list[torch.Tensor]]:
        """Register with shard ``i`` again at ``clock`` (seeding it if it came back empty) and
        pull its weights; counts the updates it lost (versions we saw that it no longer has).

        A standby that took the shard over knows our clock from its primary: where it lacks our
        push for ``clock - 1`` (the primary took it but died before passing it on), ``repush``
        gives that push again and its answer stands in for the pull."""
        if self.links[i].moved:
            h = self._while_in_use(
                lambda: self._request_one(
                    i, self._header(Op.REGISTER, clock=clock, body=RegisterRequest(resume=True))
                )
            )
            kept = reply_body(Op.REGISTER, h)
            if not kept.initialized and repush is not None:
                # it holds nothing: we seed it with the weights we read before our last push,
                # at the clock before it, and give it that push again below
                h = self._register_again(i, clock - 1)
            elif (
                kept.initialized
                and repush is not None
                and kept.clock < clock - 1
                and kept.version >= self.last_versions[i]  # it has what our last push read
            ):
                self._lost_pushes(i, clock - 1 - kept.clock)
                h = self._register_again(i, clock - 1)  # our last push, given again below
            elif not (kept.initialized and kept.clock in (clock, clock - 1) and repush):
                h = self._register_again(i, clock)
        else:
            h = self._register_again(i, clock)
        registered = reply_body(Op.REGISTER, h)
        if not self.links[i].moved:
            self.links[i].standby = registered.standby
        # a standby with nothing is seeded with our weights, at the version they carry
        restored = registered.version if registered.initialized else self.last_versions[i]
        lost = max(0, self.last_versions[i] - restored)
        self.lost_updates += lost
        if lost:
            log.warning(
                "shard %s lost %d update(s) (back at version %d)", self.addresses[i], lost, restored
            )
        if not registered.initialized:
            init, tensors = self._init_message(i)
            self.data.flush()
            self._request_one(i, init, tensors)
        self._attach(i)  # a restarted shard made new segments (or none)
        if repush is not None and registered.clock == clock - 1:
            header, tensors = repush()  # our push for clock - 1, again, with the pull after it
            self.data.flush()
            return self._request_one_reply(i, header, tensors)
        return self._request_one_reply(i, self._header(Op.PULL, clock=clock))

    def _lost_pushes(self, i: int, count: int) -> None:
        """A standby took shard ``i`` over ``count`` pushes of ours short of our last one (a
        late push k of n or patience folded into the step its primary died with, or an update
        not yet passed on): only the last push is kept to give again, so those are lost."""
        self.lost_pushes += count
        log.warning(
            "wave %s/%d: shard %s was taken over %d push(es) of this wave short of its last "
            "one, which alone is kept to give again: lost (counted as lost_pushes)",
            self.worker,
            self.wave,
            self.addresses[i],
            count,
        )

    def _register_again(self, i: int, clock: int) -> Header:
        """Register with shard ``i`` at exactly ``clock``."""
        header = self._header(Op.REGISTER, clock=clock, body=RegisterRequest(exact=True))
        return self._while_in_use(lambda: self._request_one(i, header))

    def _while_in_use(self, register):
        """Call ``register()`` until no shard answers ``wave_in_use``: a shard that has not yet
        seen our previous connection close (a restarted worker whose old host vanished without
        closing it) lets go when it does, or when it drops that connection's wave for silence;
        waits within the request timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return register()
            except RemoteError as e:
                if e.code != ErrorCode.WAVE_IN_USE or time.monotonic() > deadline:
                    raise
                log.info("wave %s/%d: %s; trying again", self.worker, self.wave, e.message)
            if self.stop.wait(0.5):
                raise StopRequested()
