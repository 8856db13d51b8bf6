"""Emulated hosts on one machine: network namespaces on a bridge, each joined by a veth pair
shaped with ``tc tbf`` in both directions, each with its own cores and its own /dev/shm
(``benchmarks/cluster.py`` runs jobs on them). Needs root, ``ip``, ``tc`` and ``taskset``;
nothing leaves the namespaces it makes, and ``close()`` removes them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

SUBNET = "169.254.78"  # link-local addresses inside the namespaces only


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


def preflight() -> str | None:
    """Why this machine cannot run the benchmark, in one line; None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc): run it as root or with sudo"
    for tool in ("ip", "tc", "taskset"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2, util-linux) on PATH"
    return None


def rate_bits(rate: str) -> float:
    """``1gbit``, ``100mbit``, ``500kbit`` in bits per second."""
    for suffix, scale in {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}.items():
        if rate.endswith(suffix):
            try:
                return float(rate[: -len(suffix)]) * scale
            except ValueError:
                break
    raise ValueError(f"--rates: {rate!r} is not like 1gbit, 100mbit or 500kbit")


def tbf(rate: str) -> list[str]:
    """A token bucket at ``rate`` whose burst exceeds the MTU and one timer tick's worth."""
    burst = max(32 * 1024, int(rate_bits(rate) / 8 / 250))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


@dataclass
class Cluster:
    """N namespaces on a bridge; ``close()`` deletes them (their links go with them)."""

    nodes: int
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    made: list[str] = field(default_factory=list)

    def ns(self, i: int) -> str:
        return f"wvc-{self.tag}-n{i}"

    def dev(self, i: int) -> str:
        return f"wc{self.tag}n{i}"

    def port(self, i: int) -> str:
        """The bridge's end of node ``i``'s link."""
        return f"wc{self.tag}s{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def switch(self) -> str:
        return f"wvc-{self.tag}-sw"

    def open(self) -> Cluster:
        sh("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, dev, port = self.ns(i), self.dev(i), self.port(i)
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "link", "set", port, "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def shape(self, rate: str) -> None:
        """Both directions of every node's link at ``rate``."""
        for i in range(self.nodes):
            for ns, dev in ((self.ns(i), self.dev(i)), (self.switch, self.port(i))):
                sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf(rate))

    def tx_bytes(self) -> int:
        """Bytes the nodes have sent on their links so far (all of them cross the bridge)."""
        total = 0
        for i in range(self.nodes):
            out = sh("ip", "-n", self.ns(i), "-s", "-j", "link", "show", "dev", self.dev(i))
            total += json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"]
        return total

    def close(self) -> None:
        for ns in reversed(self.made):
            sh("ip", "netns", "delete", ns, check=False)
        self.made.clear()


def node_command(
    cluster: Cluster, node: int, cores: str, command: list[str], cgroup: str = ""
) -> list[str]:
    """``command`` in node ``node``'s namespace, on its cores, with a /dev/shm of its own (``ip
    netns exec`` gives each command a mount namespace: the tmpfs is seen by it alone), and in
    the node's cgroup (``cgroup``: its cgroup.procs file), so that everything it starts is the
    node's: capped together, killed together."""
    script = 'mount -t tmpfs -o size=50% wavelet-node /dev/shm && exec taskset -c "$0" "$@"'
    inside = ["ip", "netns", "exec", cluster.ns(node), "sh", "-c", script, cores, *command]
    if not cgroup:
        return inside
    # into the cgroup before entering the namespace (whose /sys shows no cgroups): the same
    # process goes on as `ip netns exec`, so all it starts is in the node's cgroup
    return ["sh", "-c", f'echo $$ > "{cgroup}" && exec "$@"', "node", *inside]


def node_cores(nodes: int, per_node: int) -> list[str]:
    available = sorted(os.sched_getaffinity(0))
    if nodes * per_node > len(available):
        print(
            f"note: {nodes} nodes x {per_node} cores > {len(available)} cores here: nodes share",
            flush=True,
        )
    return [
        ",".join(str(available[(n * per_node + k) % len(available)]) for k in range(per_node))
        for n in range(nodes)
    ]
