"""Shards away from slow nodes: a shard whose node computes well below the fastest node (its
workers' measured speed, as the balancer keeps it: ``ps/balance.py``) hands itself to its
standby on a faster node, live, losing no update (the hand-over of ``ps/server.py``). A shard
shares its node's CPU with that node's worker; under a cap (a co-tenant, a throttled VM) every
wave's push to it would wait for the cap, the fast nodes' too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

SLOW_FACTOR = 1.3  # a node this much slower than the fastest gives its shards away
# pushes measured of a wave before its speed counts here: a move costs a hand-over, so it waits
# for firmer evidence than the batches, which are told again every step
MEASURED_PUSHES = 3


class SpeedPlacement:
    def __init__(
        self,
        service,
        own_node: int,
        standby_node: int,
        node_of_worker: Callable[[int], int],
        factor: float = SLOW_FACTOR,
        hosted_node: int | None = None,  # the node of the shard whose standby this process hosts
    ):
        self.service = service
        self.own_node = own_node
        self.standby_node = standby_node
        self.node_of_worker = node_of_worker
        self.factor = factor
        self.hosted_node = hosted_node
        self.avoided: set[int] = set()  # nodes no shard of this process moves onto
        self.why = ""

    def hosted_shard_taken_over(self) -> None:
        """The standby this process hosts took its shard over from ``hosted_node`` (that node
        was slow, stopping or lost): this shard never moves there. Serving two shards then
        slows this node's workers (1.3-1.4x measured under a co-tenant), and a co-tenant's free
        period made this shard follow the other onto the node it had just left, where the cap,
        coming back, held both shards and every wave with them."""
        if self.hosted_node is not None:
            self.avoided.add(self.hosted_node)

    def node_speeds(self) -> dict[int, float]:
        """Each node's workers' mean samples per second of compute, from their pushes."""
        balancer = self.service.updates.balancer
        per_node: dict[int, list[float]] = {}
        for wave in balancer.speed:
            worker = wave[0]
            measured = balancer.seen[wave] >= MEASURED_PUSHES
            if worker[:1] == "w" and worker[1:].isdigit() and measured:
                speed = balancer.steady_speed(wave)
                per_node.setdefault(self.node_of_worker(int(worker[1:])), []).append(speed)
        return {node: sum(s) / len(s) for node, s in per_node.items()}

    def due(self) -> bool:
        """Whether this shard should move to its standby now (its node is slow, the standby's
        is not)."""
        if self.own_node == self.standby_node or self.standby_node in self.avoided:
            return False
        speeds = self.node_speeds()
        mine, theirs = speeds.get(self.own_node), speeds.get(self.standby_node)
        if mine is None or theirs is None:
            return False
        fastest = max(speeds.values())
        if mine * self.factor < fastest and theirs * self.factor >= fastest:
            self.why = (
                f"its node computes {fastest / mine:.1f}x slower than the fastest (its workers' "
                f"{mine:.0f} samples/s against {fastest:.0f}): it moves to its standby's node"
            )
            return True
        return False
