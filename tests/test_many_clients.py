"""Many clients against one shard, real sockets: every push is acknowledged and counted exactly,
and no client is starved (each finishes its pushes while the others push too), asynchronous and
bulk-synchronous. Speed lives in benchmarks/ps_scale.py."""

import threading

import pytest
import torch
from helpers import TIMEOUT_S

from wavelet.common.sharding import ShardingPlan
from wavelet.scripts.stats import fetch_stats
from wavelet.worker.client import PSClient

CLIENTS = 8
PUSHES = 25


def _clients_push(addresses, pushes: int) -> list:
    """CLIENTS clients, each ``pushes`` push-and-pulls, at once; per client what went wrong."""
    errors, versions = [], {}

    def one(index: int) -> None:
        weight = torch.nn.Parameter(torch.zeros(1000))
        weight.grad = torch.full((1000,), 1e-3)
        plan = ShardingPlan.build([("w", weight, True)], len(addresses), 4 << 20)
        c = PSClient(addresses, plan, {"w": weight}, f"c{index}", 0, TIMEOUT_S)
        try:
            c.register(0)
            pulled = c.pull(0)
            for clock in range(pushes):
                pulled = c.push_pull(clock, pulled.versions)
            versions[index] = pulled.versions[0]
        except Exception as e:
            errors.append(f"client {index}: {type(e).__name__}: {e}")
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(6 * TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a client never finished: starved"
    assert not errors, errors
    return versions


@pytest.mark.timeout(240)
@pytest.mark.parametrize("updates", ["async", "bsp"])
def test_eight_clients_on_one_shard_are_all_served_and_counted(shard_daemons, updates):
    bsp = updates == "bsp"
    job = ["--staleness", "0" if bsp else "inf", "--updates", "async"]
    daemons = shard_daemons(job, count=1, expect_waves=CLIENTS if bsp else 0)
    versions = _clients_push(daemons.addresses, PUSHES)
    stats = fetch_stats(daemons.addresses)[0]
    waves = stats["waves"]
    assert sorted(waves) == sorted(f"c{i}/0" for i in range(CLIENTS))
    # every push acknowledged and counted, none lost, none twice
    assert all(w["pushes"] == PUSHES for w in waves.values()), waves
    if bsp:  # one update per clock, each the mean of every client's push
        assert stats["version"] == PUSHES
        assert set(versions.values()) == {PUSHES}
    else:  # one update per push
        assert stats["version"] == CLIENTS * PUSHES
        assert stats["rejected"] == 0
