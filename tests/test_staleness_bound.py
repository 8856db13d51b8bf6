"""The staleness bound, observed from the waves: with one wave slowed down, no pull returns
weights that break the bound; with s = inf the fast wave never waits."""

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import RawClient, client_for, run_threads, tiny_model

from wavelet.common.protocol import Header, Op

STEPS = 16


def _wave(addresses, name, delay_s, reads, errors):
    try:
        model = tiny_model()
        c = client_for(model, addresses, worker=name)
        try:
            c.register(0)
            pulled = c.pull(0)
            reads.append((0, pulled.versions, pulled.parked_s, pulled.slowest_clock))
            g = torch.Generator().manual_seed(len(name))
            for clock in range(STEPS):
                time.sleep(delay_s)
                model.zero_grad()
                x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
                F.cross_entropy(model(x), y).backward()
                pulled = c.push_pull(clock, pulled.versions)
                reads.append((clock + 1, pulled.versions, pulled.parked_s, pulled.slowest_clock))
            c.leave()
        finally:
            c.close()
    except BaseException as e:
        errors.append(e)


def _run(daemons, slow_delay_s):
    fast, slow, errors = [], [], []
    threads = [
        threading.Thread(target=_wave, args=(daemons.addresses, "fast", 0.0, fast, errors)),
        threading.Thread(
            target=_wave, args=(daemons.addresses, "slow", slow_delay_s, slow, errors)
        ),
    ]
    run_threads(threads, errors)
    return fast, slow


def _parked(address, worker):
    raw = RawClient(address)
    try:
        return raw.request(Header(op=Op.STATS)).body["waves"][f"{worker}/0"]["parked"]
    finally:
        raw.close()


@pytest.mark.parametrize(
    "s,policy",
    [(0, "apply"), (1, "apply"), (3, "apply"), (2, "scale"), (2, "drop"), (2, "dc-asgd")],
)
def test_bound_holds_with_a_slow_wave(shard_daemons, s, policy):
    daemons = shard_daemons(
        ["--staleness", str(s), "--stale-policy", policy, "--set", "drop_limit=1"],
        count=2,
        expect_waves=2,
    )
    fast, _ = _run(daemons, slow_delay_s=0.03)
    for clock, versions, _, slowest in fast:
        # what each shard says the slowest live wave's clock was when it served the read
        assert all(c >= min(clock - s, STEPS) or c == -1 for c in slowest), (clock, slowest)
        if policy == "drop":
            continue  # dropped pushes apply nothing, so versions no longer count pushes
        for v in versions:
            if s == 0:
                # bulk-synchronous: one update per clock, every wave reads the same version
                assert v == clock
            else:
                # every push is one update (a dropped one too: it still advances the clock,
                # so count the fast wave's own pushes, not the versions, for it)
                slow_clock = v - clock
                assert slow_clock >= min(clock - s, STEPS), (clock, v, s)
    assert _parked(daemons.addresses[0], "fast") > 0, "the bound never held the fast wave back"


def test_asynchronous_fast_wave_never_waits(shard_daemons):
    daemons = shard_daemons(["--staleness", "inf"], count=2, expect_waves=2)
    fast, slow = _run(daemons, slow_delay_s=0.03)
    # after the start barrier, the fast wave is never parked
    assert all(parked == 0.0 for _, _, parked, _ in fast[1:])
    assert _parked(daemons.addresses[0], "fast") <= 1  # the start barrier alone, at most
    # ...and it really ran ahead: at some read the slow wave was several clocks behind
    assert max(c - (v[0] - c) for c, v, _, _ in fast) >= 4
