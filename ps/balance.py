"""Speed-balanced batches: under a synchronous rule every wave of a step waits for the slowest,
so each wave's batch follows its measured speed and the waves of a step finish together (LB-BSP,
SoCC 2020; Cannikin, Middleware 2024). The step still averages over all its samples (the sums
weigh each push by its samples, ``ps/synchronous.py``), so its meaning does not change; only how
the samples are split among the waves does.

Each push says how many samples it carried and how long the wave computed them (forward and
backward, no waiting); a wave's speed is its samples over its compute seconds in its latest
pushes, a sum rather than an average of each push's rate (a node under a cgroup cap computes one
step at full speed and the next at a fraction, as its quota runs out: a throttled node's rates
swung 2.5x from one push to the next), and its first ``WARMUP`` pushes are not counted (the
first step allocates: it measured a third of the later ones' speed). The latest pushes are as
few as hold ``WINDOW_S`` seconds of compute (at least ``MIN_WINDOW``, at most ``WINDOW``): enough
of a cap's periods to smooth its swing, and no more, for a co-tenant that comes and goes must
move the batches within a few steps (a window of 8 pushes took 6 s to follow a cap that came on,
and 3 s to follow it going, of every 10 s on and 10 s off). And where the latest ``MIN_WINDOW``
pushes ran ``CHANGE`` times faster or slower than those before them, a cap came or went: the
pushes before are forgotten. Without that, a wave freed of a cap kept its capped pushes in its
window while its fast ones, short on small batches, added up to ``WINDOW_S`` (its batch took 5 s
to grow back); a steady cap's swing from push to push does not reach ``CHANGE`` over two pushes.
The batches follow from a wave's second push on (``MIN_SAMPLES``): under a cap from the start,
every step before them ran at the slow node's pace. The waves of one worker share one window:
they run one model on one device, so a cap that comes or goes shows in the next push of either
(a window per wave saw it only after two pushes of each: under a co-tenant, node 0 ran at the
capped node's pace for two of its steps, about 2 s, after every cap came on). Each push also
says what the wave's last step cost besides computing and waiting for its turn (the weights and
gradients on the wire to every shard, the loop's own work): the wave's overhead, a cost per step
whatever its batch (the median of its last ``OVERHEADS``, so that one stall does not swing the
batches). The wave measures it, not the shard: a shard sees only its own wire, and where each
node hosts a shard every wave is remote to one of them. A wave that computes its samples in b / v
seconds after an overhead o pushes at o + b / v; the balancer answers each read with the batch
that makes those times equal across a group: with B the group's samples per step (its waves times
the job's batch), every wave pushes at t = (B + sum v o) / sum v, and wave i takes v_i (t - o_i),
each at least 1 and at most ``max_factor`` times the job's batch (where that bound holds a wave
back, t is its push time at the bound, and the others shrink to push with it: a batch sized to
a device's memory may not grow; ``balance_max_factor``) (measured here, a remote node's
push arrived 28 ms after a local one's when only speeds counted: a seventh of each turn).
``balance_batches = "auto"`` balances only while, at equal batches, the slowest wave of a group
would push over ``ON_SPREAD`` times later than the fastest, and stops below ``OFF_SPREAD`` (a co-
tenant that comes and goes); ``wavelet stats`` and the summary's update rule say when it
balances, and how far apart the waves were.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from wavelet.ps.staleness import WaveId

WINDOW = 8  # a wave's speed: its samples over its compute seconds in at most this many pushes
MIN_WINDOW = 2  # and at least this many
WINDOW_S = 0.75  # the fewest latest pushes that hold this many seconds of compute
WARMUP = 1  # pushes of each wave not counted: the first step allocates and warms caches
ON_SPREAD = 1.3  # auto: balance once the fastest wave is this much faster than the slowest
OFF_SPREAD = 1.15  # auto: and go back to equal batches below this
MIN_SAMPLES = 1  # measurements of every wave before its speed counts (after the WARMUP ones)
CHANGE = 2.0  # the latest MIN_WINDOW pushes this much faster or slower: a new pace
OVERHEADS = 8  # each wave's overhead: the median of its last this many steps


class BatchBalancer:
    def __init__(
        self,
        mode: str,
        batch_size: int,
        group_of: Callable[[WaveId], Hashable],
        max_factor: float,  # no wave's batch beyond this many times the job's
    ):
        self.mode = mode  # on, off, auto
        self.batch_size = batch_size
        self.max_batch = max_factor * batch_size
        self.group_of = group_of
        self.speed: dict[WaveId, float] = {}  # samples per second of compute, latest pushes
        self.seen: dict[WaveId, int] = {}  # pushes counted (after the WARMUP ones)
        self.pushes: dict[WaveId, int] = {}  # pushes measured, the WARMUP ones too
        # (samples, compute seconds) of each worker's latest pushes, all its waves'
        self.window: dict[str, deque[tuple[int, float]]] = {}
        # its last WINDOW pushes whatever their pace, for slower decisions (moving a shard)
        self.history: dict[WaveId, deque[tuple[int, float]]] = {}
        self.overheads: dict[WaveId, deque[float]] = {}  # seconds per step besides compute
        self.active: dict[Hashable, bool] = {}
        self.changes: list[dict] = []  # when auto turned balancing on or off, and why

    def record(self, wave: WaveId, samples: int, compute_s: float, overhead_s: float = 0.0) -> None:
        """A push of ``samples`` computed in ``compute_s`` seconds (0: not measured), whose
        wave's last step cost ``overhead_s`` seconds besides (0: not measured)."""
        if samples <= 0 or compute_s <= 0:  # kept even when off: placement reads the speeds
            return
        self.pushes[wave] = self.pushes.get(wave, 0) + 1
        if self.pushes[wave] <= WARMUP:
            return
        window = self.window.setdefault(wave[0], deque(maxlen=WINDOW))
        window.append((samples, compute_s))
        self.history.setdefault(wave, deque(maxlen=WINDOW)).append((samples, compute_s))
        _forget_an_old_pace(window)
        self.seen[wave] = self.seen.get(wave, 0) + 1
        speed = _latest_speed(window)
        for counted in self.seen:  # its worker's waves measured so far
            if counted[0] == wave[0]:
                self.speed[counted] = speed
        if overhead_s > 0:
            self.overheads.setdefault(wave, deque(maxlen=OVERHEADS)).append(overhead_s)

    def steady_speed(self, wave: WaveId) -> float:
        """``wave``'s samples per compute second over its last ``WINDOW`` pushes, a new pace or
        not: what a one-way decision such as moving a shard should go by, for a co-tenant that
        just left may come back (a shard moved onto a node freed a moment ago stalled every
        wave when the cap came back)."""
        return _speed(self.history[wave])

    def overhead(self, wave: WaveId) -> float:
        """``wave``'s seconds per step besides its compute (0 until measured)."""
        overheads = self.overheads.get(wave)
        return statistics.median(overheads) if overheads else 0.0

    def forget(self, wave: WaveId) -> None:
        self.speed.pop(wave, None)
        self.seen.pop(wave, None)
        self.pushes.pop(wave, None)
        self.history.pop(wave, None)
        self.overheads.pop(wave, None)
        if not any(w[0] == wave[0] for w in self.pushes):  # its worker's last wave
            self.window.pop(wave[0], None)

    def batch_for(self, wave: WaveId, live: set[WaveId]) -> int:
        """The batch ``wave`` should take next (0 where balancing is off: the job's). Where it
        is on or auto but not balancing now, the job's batch, said outright: a wave keeps the
        last batch it was told, and one balanced earlier (a co-tenant that left, a group that
        changed) must come back to it."""
        if self.mode == "off":
            return 0
        group = self.group_of(wave)
        members = [w for w in live if self.group_of(w) == group]
        if len(members) < 2 or any(self.seen.get(w, 0) < MIN_SAMPLES for w in members):
            return self.batch_size
        speeds = {w: self.speed[w] for w in members}
        overheads = {w: self.overhead(w) for w in members}
        if not self._balancing(group, speeds, overheads):
            return self.batch_size
        total = self.batch_size * len(members)
        # every wave of the group pushes at t: o_i + b_i / v_i = t, and sum b_i = total
        t = (total + sum(speeds[w] * overheads[w] for w in members)) / sum(speeds.values())
        # no wave beyond the bound: where it would go past, the others push when it does
        t = min(t, min(overheads[w] + self.max_batch / speeds[w] for w in members))
        batch = speeds[wave] * (t - overheads[wave])
        return int(min(max(1, round(batch)), self.max_batch))

    def _balancing(
        self, group: Hashable, speeds: dict[WaveId, float], overheads: dict[WaveId, float]
    ) -> bool:
        if self.mode == "on":
            return True
        # when each would push at equal batches
        times = [overheads[w] + self.batch_size / max(speeds[w], 1e-12) for w in speeds]
        spread = max(times) / max(min(times), 1e-12)
        was = self.active.get(group, False)
        now = spread > ON_SPREAD if not was else spread > OFF_SPREAD
        if now != was:
            self.active[group] = now
            change = {"t": time.time(), "group": str(group), "on": now, "spread": spread}
            self.changes.append(change)
        return now

    def describe(self) -> str:
        """What the balancer does now, for ``wavelet stats`` and the summary."""
        if self.mode == "off":
            return ""
        if self.mode == "on":
            return "balanced batches"
        if not any(self.active.values()):
            return ""  # equal batches: the waves' speeds are within ON_SPREAD
        last = self.changes[-1]
        return f"balanced batches (waves {last['spread']:.1f}x apart)"


def _forget_an_old_pace(window: deque[tuple[int, float]]) -> None:
    """Keep only the latest ``MIN_WINDOW`` pushes where their speed is ``CHANGE`` times that of
    all the pushes before them in ``window``, either way (a cap came on or went)."""
    if len(window) < MIN_WINDOW + 2:
        return
    pushes = list(window)
    latest, before = _speed(pushes[-MIN_WINDOW:]), _speed(pushes[:-MIN_WINDOW])
    if max(latest / before, before / latest) > CHANGE:
        for _ in range(len(window) - MIN_WINDOW):
            window.popleft()


def _speed(pushes: Sequence[tuple[int, float]]) -> float:
    return sum(n for n, _ in pushes) / sum(s for _, s in pushes)


def _latest_speed(window: deque[tuple[int, float]]) -> float:
    """Samples per compute second over the fewest latest pushes of ``window`` that hold
    ``WINDOW_S`` seconds of compute (at least ``MIN_WINDOW`` of them where there are)."""
    samples, seconds = 0, 0.0
    for taken, (n, compute_s) in enumerate(reversed(window), start=1):
        samples, seconds = samples + n, seconds + compute_s
        if seconds >= WINDOW_S and taken >= MIN_WINDOW:
            break
    return samples / seconds
