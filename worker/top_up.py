"""Top-ups: under wave turns, a wave done with its batch before the rest of its group computes on.

Under wave turns every wave of a group pushes the same clock and the group's update waits for
the last; on a node that finished first the core idles meanwhile (33-49 ms per turn under a
quota-capped node, docs/stragglers.md), and balanced batches cannot foresee when a capped
node's step ends within its CFS period. With ``top_up`` the wave tells shard 0 it is ready
(``ready``, ps/ready.py) and, until shard 0 answers that every wave of its group is ready too,
computes extra batches of ``top_up_samples`` on the weights it read, adding their gradients to
its step's. Its push is then the mean over all its samples and says so (``samples``), which the
shards' synchronous sum weighs by, so the update stays the mean over every sample of the turn:
one process's step on all of them (tests/test_top_up.py). Nothing it computes is stale, and a
step tops up at most its own batch's samples, so a shard that never answers costs one batch.

Why not push the extra samples on their own: they would be a push of the next clock computed on
the weights before it, the staleness that reading a turn early was measured to cost
(docs/stragglers.md). The other wave of the device waits for this group's update meanwhile (the
turn order), so a top-up computes without the forward baton and holds no more activations than
the step before it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import zmq

from wavelet.common.batches import batch_samples, to_device
from wavelet.common.protocol import Op, decode_reply

READY_WAIT_S = 0.003  # how long a wave first waits for shard 0's answer before it tops up
# an extra batch's compute, when its size follows the wave's speed (top_up_samples 0): the
# group's last wave may finish during one, and then every wave waits for its end
TOP_UP_S = 0.015
MIN_TOP_UP = 2  # samples: BatchNorm needs more than one


class TopUp:
    """One wave's top-ups: ``after_backward`` runs between its backward and its push."""

    def __init__(self, part, job, step, compute, device: torch.device, seed: int, stop):
        self.part, self.step, self.compute, self.device = part, step, compute, device
        self.fixed = job.top_up_samples  # 0: follow the wave's speed (TOP_UP_S)
        self.job_batch = job.batch_size
        self.size = self.fixed or MIN_TOP_UP
        self._room = 0  # samples the step may still top up: the last extra batch is cut to it
        self.seed = seed + 104729  # its own order over the wave's part
        self.stop = stop
        self._epoch = -1
        self._batches: Iterator[Any] | None = None

    def after_backward(
        self, model, client, clock: int, base: int, ends: float | None, sample_s: float
    ):
        """Top up the gradients ``model`` holds (the mean over ``base`` samples) until shard 0
        says the group is ready, the step has topped up ``base`` samples, the budget (``ends``,
        monotonic) runs out or the wave stops; then the gradients are the mean over all of
        them. ``sample_s``: the step's compute per sample, which sizes the extra batches.
        A wave whose balanced batch is below the job's is the slower kind, which the others
        wait for: it tops up nothing (its extra batch would hold the whole group). Returns
        (samples added, seconds spent computing them)."""
        if base < self.job_batch:
            return 0, 0.0
        if not self.fixed:
            self.size = max(MIN_TOP_UP, min(base, round(TOP_UP_S / max(sample_s, 1e-6))))
        rid = _send_ready(client, clock)
        if rid is None or _ready_answered(client, rid, READY_WAIT_S):
            return 0, 0.0

        def done() -> bool:
            over = ends is not None and time.monotonic() >= ends
            return over or self.stop.is_set() or _ready_answered(client, rid, 0.0)

        return self.accumulate_until(model, base, done)

    def accumulate_until(self, model, base: int, done) -> tuple[int, float]:
        """Add extra batches' gradients to the step's (the mean over ``base`` samples in the
        model's ``.grad``) until ``done()`` or ``base`` samples were added, then leave the mean
        over all of them; (samples added, seconds spent)."""
        extra, spent = 0, 0.0
        while extra < base and not done():
            self._room = base - extra
            batch = self._next()
            began = time.perf_counter()
            self.compute(self._accumulate, model, batch, base)
            spent += time.perf_counter() - began
            extra += batch_samples(batch)
        if extra:
            scale = base / (base + extra)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return extra, spent

    def _accumulate(self, model, batch, base: int) -> None:
        """Add this batch's gradient to the step's, weighed as ``batch``'s samples over the
        step's ``base``: after every top-up the gradients are the sum over all samples over
        ``base``, which the caller scales to their mean."""
        loss, _ = self.step(model, batch)
        (loss * (batch_samples(batch) / base)).backward()

    def _next(self):
        while True:
            if self._batches is None:
                self._epoch += 1
                sizes = lambda: min(self.size, self._room)  # noqa: E731 (read at each draw)
                self._batches = iter(self.part.batches(self.size, self._epoch, self.seed, sizes))
            try:
                return to_device(next(self._batches), self.device, non_blocking=True)
            except StopIteration:
                self._batches = None  # the next epoch of this order


def _send_ready(client, clock: int) -> int | None:
    """Queue a ``ready`` for ``clock`` to shard 0; its request id (None: it could not be
    queued, so the wave pushes now)."""
    h = client._header(Op.READY, clock=clock)
    h.request_id = rid = next(client._ids)
    return rid if client._try_send(0, h, []) else None


def _ready_answered(client, rid: int, wait_s: float) -> bool:
    """Whether shard 0 answered ``ready`` ``rid`` (an error counts: the wave pushes now and the
    push meets whatever is wrong), waiting up to ``wait_s``. Only this wave's thread reads its
    sockets, and between its steps nothing else of it is outstanding: a late answer to an
    earlier request is dropped, as the client's own reads drop it."""
    sock = client.links[0].socket
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        if not sock.poll(max(0, int(left * 1000))):
            return False
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            continue
        client.links.answered(0)
        h, _ = decode_reply(frames, client.addresses[0])
        if h.request_id == rid:
            return True
