"""Speed-balanced batches (ps/balance.py): each wave's batch is what makes the waves of a step
push at the same moment, its compute and its overhead per step (the wire) both counted, from
measurements that one stall does not swing. Arithmetic only: the balancer is fed the times the
waves' pushes would report."""

import pytest

from wavelet.common.config import JobConfig
from wavelet.ps.balance import MIN_SAMPLES, MIN_WINDOW, WARMUP, WINDOW, BatchBalancer

FAST, SLOW = ("w0", 0), ("w1", 0)
LIVE = {FAST, SLOW}


def _balancer(mode="on", batch=32, max_factor=JobConfig().balance_max_factor):
    return BatchBalancer(mode, batch, lambda wave: wave[1], max_factor)  # a group per wave index


def _feed(b, wave, samples, compute_s, overhead_s, steps=WARMUP + MIN_SAMPLES):
    """``steps`` pushes of ``wave``, each saying what its step cost besides computing."""
    for _ in range(steps):
        b.record(wave, samples, compute_s, overhead_s)


def _push_time(b, wave, batch):
    return b.overhead(wave) + batch / b.speed[wave]


@pytest.mark.timeout(10)
def test_batches_follow_speed_where_no_wave_pays_more_per_step():
    b = _balancer()
    _feed(b, FAST, 32, 0.1, 0.0)  # 320 samples/s
    _feed(b, SLOW, 32, 0.2, 0.0)  # 160 samples/s
    assert (b.batch_for(FAST, LIVE), b.batch_for(SLOW, LIVE)) == (43, 21)  # 64 as 2:1


@pytest.mark.timeout(10)
def test_a_wave_with_a_longer_wire_takes_less_so_that_both_push_together():
    b = _balancer()
    _feed(b, FAST, 32, 0.1, 0.005)  # local: 5 ms besides compute
    _feed(b, SLOW, 32, 0.2, 0.050)  # remote: 50 ms on the wire
    fast, slow = b.batch_for(FAST, LIVE), b.batch_for(SLOW, LIVE)
    assert fast + slow == 64
    assert slow < 21  # less than speed alone would give it
    # both push within one sample's compute of each other; with speeds alone the remote wave
    # would push 45 ms after the local one
    assert abs(_push_time(b, FAST, fast) - _push_time(b, SLOW, slow)) < 1 / 160
    assert _push_time(b, SLOW, 21) - _push_time(b, FAST, 43) > 0.04


@pytest.mark.timeout(10)
def test_one_stalled_cycle_does_not_swing_the_batches():
    b = _balancer()
    _feed(b, FAST, 32, 0.1, 0.005, steps=7)
    _feed(b, SLOW, 32, 0.2, 0.050, steps=7)
    before = b.batch_for(FAST, LIVE), b.batch_for(SLOW, LIVE)
    _feed(b, FAST, 32, 0.1, 2.0, steps=1)  # e.g. a test run inline: 2 s without a push
    assert (b.batch_for(FAST, LIVE), b.batch_for(SLOW, LIVE)) == before


@pytest.mark.timeout(10)
def test_auto_balances_only_while_the_waves_would_push_far_apart():
    b = _balancer("auto")
    _feed(b, FAST, 32, 0.1, 0.01)
    _feed(b, SLOW, 32, 0.11, 0.01)  # within ON_SPREAD: equal batches, the job's
    assert b.batch_for(FAST, LIVE) == b.batch_for(SLOW, LIVE) == 32
    _feed(b, SLOW, 32, 0.4, 0.01, steps=10)  # a co-tenant arrives on the slow wave's node
    assert b.batch_for(FAST, LIVE) > 32 > b.batch_for(SLOW, LIVE) > 0
    assert "balanced batches" in b.describe()
    _feed(b, SLOW, 32, 0.1, 0.01, steps=10)  # and leaves: back to the job's batch, said
    # outright, for a wave keeps the last batch it was told
    assert b.batch_for(FAST, LIVE) == b.batch_for(SLOW, LIVE) == 32


@pytest.mark.timeout(10)
def test_no_batch_before_every_wave_is_measured_nor_beyond_the_bounds():
    b = _balancer()
    _feed(b, FAST, 32, 0.1, 0.0, steps=WARMUP + MIN_SAMPLES - 1)
    _feed(b, SLOW, 32, 0.2, 0.0)
    assert b.batch_for(FAST, LIVE) == 32  # the job's
    _feed(b, FAST, 32, 0.001, 0.0, steps=10)  # 100x faster: bounded at 4x the job's batch
    _feed(b, SLOW, 32, 0.2, 1.0, steps=10)  # and an overhead longer than the fast one's step
    assert b.batch_for(FAST, LIVE) == 4 * 32
    assert b.batch_for(SLOW, LIVE) == 1


@pytest.mark.timeout(10)
def test_a_throttled_waves_speed_is_what_it_sustains_and_its_first_push_does_not_count():
    """A cgroup cap lets one step run at full speed and stalls the next: the speed is what the
    wave sustains (the mean of its rates would overstate it), and the first, allocating step
    does not count."""
    b = _balancer()
    b.record(SLOW, 32, 1.0)  # the first step: allocations, cold caches
    assert SLOW not in b.speed
    for _ in range(4):
        b.record(SLOW, 32, 0.1)  # within the quota: 320 samples/s
        b.record(SLOW, 32, 0.3)  # the quota ran out: 107 samples/s
    assert b.speed[SLOW] == pytest.approx(64 / 0.4)  # 160, where the rates average 213


@pytest.mark.timeout(10)
def test_balancing_off_answers_nothing_and_leaves_the_batches_alone():
    b = _balancer("off")
    _feed(b, FAST, 32, 0.1, 0.0)
    _feed(b, SLOW, 32, 0.4, 0.0)
    assert b.batch_for(FAST, LIVE) == b.batch_for(SLOW, LIVE) == 0  # 0: unchanged


@pytest.mark.timeout(10)
def test_a_co_tenant_that_comes_and_goes_moves_the_batches_within_a_few_pushes():
    """The speed holds as few latest pushes as make WINDOW_S of compute: a cap that comes on
    shows in two slow pushes, and one that goes within WINDOW fast ones, not after a long
    window has turned over (a co-tenant 10 s on and 10 s off left the batches wrong for 6 s)."""
    b = _balancer("auto")
    _feed(b, FAST, 32, 0.1, 0.01, steps=10)
    _feed(b, SLOW, 32, 0.1, 0.01, steps=10)
    assert b.batch_for(SLOW, LIVE) == 32
    _feed(b, SLOW, 32, 0.4, 0.01, steps=MIN_WINDOW)  # a co-tenant arrives: 4x slower
    assert b.speed[SLOW] == pytest.approx(80)  # its new speed alone, no fast push mixed in
    fast, slow = b.batch_for(FAST, LIVE), b.batch_for(SLOW, LIVE)
    assert (fast, slow) == (51, 13)  # both push 0.17 s after they start: 4:1, less overheads
    # it leaves: small batches, fast, whose compute would take WINDOW pushes to outweigh the
    # capped ones; two of them at 4x the pace before are a new pace, the capped ones forgotten
    _feed(b, SLOW, slow, slow / 320, 0.01, steps=MIN_WINDOW)
    assert b.speed[SLOW] == pytest.approx(320)
    assert b.batch_for(FAST, LIVE) == b.batch_for(SLOW, LIVE) == 32


@pytest.mark.timeout(10)
def test_a_workers_waves_share_its_pace_so_a_cap_shows_in_the_next_push_of_either():
    """Two workers of two waves each (a group per wave index): a cap on worker w1 shows in two
    slow pushes of its wave 0 alone, and its wave 1, which has not pushed since, takes the
    capped batch at once: one model on one device, one pace. Worker w0 is left alone."""
    b = _balancer("auto")
    waves = [(w, i) for w in ("w0", "w1") for i in (0, 1)]
    for _ in range(10):
        for wave in waves:
            b.record(wave, 32, 0.1, 0.01)
    live = set(waves)
    assert {b.batch_for(w, live) for w in waves} == {32}
    _feed(b, ("w1", 0), 32, 0.4, 0.01, steps=MIN_WINDOW)  # a co-tenant arrives on w1: 4x slower
    assert b.speed[("w1", 1)] == b.speed[("w1", 0)] == pytest.approx(80)
    assert b.speed[("w0", 0)] == b.speed[("w0", 1)] == pytest.approx(320)
    assert (b.batch_for(("w0", 1), live), b.batch_for(("w1", 1), live)) == (51, 13)
    b.forget(("w1", 0))
    assert "w1" in b.window  # its other wave still pushes
    b.forget(("w1", 1))
    assert "w1" not in b.window


@pytest.mark.timeout(10)
def test_a_steady_caps_swing_is_not_taken_for_a_new_pace():
    """Under a steady cap a wave runs one step within its quota and the next throttled: the
    speed stays the sustained one, every push of the window counted."""
    b = _balancer()
    b.record(SLOW, 32, 1.0)  # the first, allocating step
    for _ in range(WINDOW):
        b.record(SLOW, 32, 0.1)  # within the quota: 320 samples/s
        b.record(SLOW, 32, 0.25)  # the quota ran out: 128 samples/s
    sustained = b.speed[SLOW]
    assert len(b.window[SLOW[0]]) == WINDOW and 128 < sustained < 200
    b.record(SLOW, 32, 0.1)
    b.record(SLOW, 32, 0.1)  # two lucky steps in a row: 1.75x the pace before, under CHANGE
    assert len(b.window[SLOW[0]]) == WINDOW  # nothing forgotten
    assert b.speed[SLOW] < 1.3 * sustained  # far from the lucky steps' 320


@pytest.mark.timeout(10)
def test_a_batch_sized_to_memory_never_grows_the_slower_wave_shrinks_to_push_with_it():
    """balance_max_factor 1 (a batch sized to the device's memory, as compare's budget): the
    faster wave keeps the job's batch, the slower takes what it computes in the same time, and
    both push together; at 1.25 the faster grows to 40 of the 43 it would take unbounded, and
    the slower matches its push time."""
    for factor, fast_batch in ((1.0, 32), (1.25, 40)):
        b = _balancer(max_factor=factor)
        _feed(b, FAST, 32, 0.1, 0.005)  # 320 samples/s
        _feed(b, SLOW, 32, 0.2, 0.005)  # 160 samples/s
        fast, slow = b.batch_for(FAST, LIVE), b.batch_for(SLOW, LIVE)
        assert fast == fast_batch  # 43 without the bound
        assert slow == round(fast_batch / 2)
        assert abs(_push_time(b, FAST, fast) - _push_time(b, SLOW, slow)) < 1 / 160
