"""What a process may use of its machine: cores by affinity, the interface of an address, and
gloo's interface under torchrun on several nodes."""

import os
import subprocess
import sys

from wavelet.common.machine import interface_of, usable_cores
from wavelet.scripts.run import Role, _gloo_interface


def test_cores_follow_the_affinity_mask():
    pinned = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c",
         "from wavelet.common.machine import usable_cores; print(usable_cores())"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.strip() == "1"
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_interface_of_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.1") is None  # TEST-NET-1: on no interface here


def test_gloo_uses_the_interface_that_routes_to_the_master(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("WAVELET_HOST", raising=False)
    two_nodes = Role(rank=2, local_rank=0, world=4, local_world=2, node=1, restart=0,
                     master_addr="127.0.0.1", master_port=29400, run_id="t")  # fmt: skip
    _gloo_interface(two_nodes)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    _gloo_interface(two_nodes)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine"  # the user's choice stands
