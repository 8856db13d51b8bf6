"""Shards away from slow nodes (``ps/placement.py``): which shard moves to its standby's node,
when, and onto which node none ever moves."""

import pytest
from helpers import service_for


def test_a_shard_on_a_node_measured_slow_moves_to_its_standbys_faster_node(tmp_path):
    """Node 1's workers compute at half node 0's speed (their pushes say so): shard 1, on
    node 1 with its standby on node 0, should move; shard 0 (node 0) should not; nor should
    anything move before every node has been measured over MEASURED_PUSHES pushes."""
    from wavelet.ps.balance import WARMUP
    from wavelet.ps.placement import MEASURED_PUSHES, SpeedPlacement

    service = service_for(tmp_path, job={"staleness": 0})
    try:
        placement = {
            node: SpeedPlacement(service, node, 1 - node, node_of_worker=lambda r: r)
            for node in (0, 1)
        }
        balancer = service.updates.balancer
        for _ in range(WARMUP + MEASURED_PUSHES):
            balancer.record(("w0", 0), 32, 0.1)  # 320 samples/s
        assert not placement[1].due()  # node 1 not measured yet
        for _ in range(WARMUP + MEASURED_PUSHES - 1):
            balancer.record(("w1", 0), 32, 0.2)  # 160 samples/s
        assert not placement[1].due()  # measured, but not often enough to move a shard
        balancer.record(("w1", 0), 32, 0.2)
        assert placement[1].due() and "2.0x slower" in placement[1].why
        assert not placement[0].due()
    finally:
        service.close()


def test_a_node_freed_a_moment_ago_takes_no_shard_until_it_stays_fast(tmp_path):
    """Node 1's co-tenant has just left: two fast pushes make its batches follow at once (a new
    pace), but moving node 0's shard there cannot be undone (a moved shard has no standby), so
    it goes by the last WINDOW pushes: the cap may come back."""
    from wavelet.ps.balance import MIN_WINDOW, WARMUP, WINDOW
    from wavelet.ps.placement import SpeedPlacement

    service = service_for(tmp_path, job={"staleness": 0})
    try:
        placement = SpeedPlacement(service, 0, 1, node_of_worker=lambda r: r)
        balancer = service.updates.balancer
        for _ in range(WARMUP + WINDOW):
            balancer.record(("w0", 0), 32, 0.15)  # 213 samples/s
            balancer.record(("w1", 0), 8, 0.2)  # capped: 40 samples/s, a small batch
        for _ in range(MIN_WINDOW):
            balancer.record(("w1", 0), 8, 0.02)  # freed: 400 samples/s
        assert balancer.speed[("w1", 0)] == pytest.approx(400)  # the batches follow now
        assert not placement.due()
        for _ in range(WINDOW - MIN_WINDOW):
            balancer.record(("w1", 0), 8, 0.02)  # it stays fast
        assert placement.due() and "1.9x slower" in placement.why
    finally:
        service.close()


def test_no_shard_follows_another_onto_the_node_it_left(tmp_path):
    """Two nodes: shard 1 left node 1 for its standby in shard 0's process on node 0. Serving
    both slows node 0's workers, and in a co-tenant's free period node 1 runs faster than node
    0 for a while: shard 0 must not move onto node 1, where the cap would come back."""
    from wavelet.ps.balance import WARMUP, WINDOW
    from wavelet.ps.placement import SpeedPlacement

    service = service_for(tmp_path, job={"staleness": 0})
    try:
        placement = SpeedPlacement(service, 0, 1, node_of_worker=lambda r: r, hosted_node=1)
        balancer = service.updates.balancer
        for _ in range(WARMUP + WINDOW):
            balancer.record(("w0", 0), 32, 0.2)  # 160 samples/s
            balancer.record(("w1", 0), 32, 0.1)  # 320 samples/s
        assert placement.due()  # before the take-over, node 1 is simply the faster
        placement.hosted_shard_taken_over()
        assert not placement.due()
    finally:
        service.close()
