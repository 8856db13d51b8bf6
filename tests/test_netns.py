"""A shard and a worker on two hosts (network namespaces made by the test, joined by a veth pair on
link-local addresses): the link is cut for a few seconds and restored, and the job continues.
Needs root and `ip netns`; skipped otherwise. No traffic leaves the two namespaces."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import CHILD_ENV, run_wavelet
from helpers import record_samples

from wavelet.common.records import read_records

PS_ADDR, WK_ADDR = "169.254.77.1", "169.254.77.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    tag = uuid.uuid4().hex[:6]
    ps_ns, wk_ns = f"wv-ps-{tag}", f"wv-wk-{tag}"
    try:
        _ip("netns", "add", ps_ns)
    except (subprocess.CalledProcessError, OSError):
        pytest.skip("cannot create network namespaces here")
    try:
        _ip("netns", "add", wk_ns)
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        _ip("link", "set", f"va{tag}", "netns", ps_ns)
        _ip("link", "set", f"vb{tag}", "netns", wk_ns)
        for ns, dev, addr in ((ps_ns, f"va{tag}", PS_ADDR), (wk_ns, f"vb{tag}", WK_ADDR)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ps_ns, wk_ns, f"vb{tag}"
    finally:
        for ns in (ps_ns, wk_ns):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=10)


def _in(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-m", "wavelet.scripts.cli", *args]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_job_survives_a_cut_link(two_hosts, tmp_path):
    ps_ns, wk_ns, wk_dev = two_hosts
    address = f"tcp://{PS_ADDR}:5571"
    # long enough that the cut, at about step 30 of 220, comes well before the end
    epochs = 10
    job = ["--epochs", str(epochs), "--shards", "1"]
    procs = []
    try:
        with open(tmp_path / "ps.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    _in(
                        ps_ns,
                        "ps",
                        *job,
                        "--bind",
                        address,
                        "--insecure",
                        "--expect-waves",
                        "2",
                        "--run-dir",
                        str(tmp_path / "ps"),
                    ),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=CHILD_ENV,
                )
            )
        with open(tmp_path / "worker.log", "wb") as log:
            worker = subprocess.Popen(
                _in(
                    wk_ns,
                    "worker",
                    *job,
                    "--shard",
                    address,
                    "--threads",
                    "1",
                    "--run-dir",
                    str(tmp_path / "run"),
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=CHILD_ENV,
            )
            procs.append(worker)
        records = tmp_path / "run" / "records" / "worker-0-wave-0.jsonl"
        deadline = time.monotonic() + 90
        while not (records.exists() and records.stat().st_size > 30_000):
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        _ip("-n", wk_ns, "link", "set", wk_dev, "down")
        time.sleep(3)
        cut = len([r for r in read_records(records) if r["kind"] == "step"])
        _ip("-n", wk_ns, "link", "set", wk_dev, "up")
        assert worker.wait(150) == 0, (tmp_path / "worker.log").read_text()[-3000:]
        steps = [r for r in read_records(records) if r["kind"] == "step"]
        assert len(steps) == epochs * 22 and len(steps) > cut
        assert "without authentication" in (tmp_path / "ps.log").read_text()
    finally:
        for p in procs:  # a clean stop first: the shard removes its shared-memory segments
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.send_signal(signal.SIGKILL)
                    p.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_nodes_under_torchrun_train_the_default_job(two_hosts, tmp_path):
    """Two "nodes" (the namespaces), each running the same torchrun command with the c10d
    rendezvous: one shard and one worker each, shards on the node's own address, over TCP with
    CURVE keys from a folder both read."""
    ps_ns, wk_ns, _ = two_hosts
    keys = tmp_path / "keys"
    made = run_wavelet("keys", "--job", str(keys), timeout=60)
    assert made.returncode == 0, made.stderr
    # node a hosts the rendezvous store (its address is not the machine's host name's)
    nodes = ((ps_ns, PS_ADDR, "a", "true"), (wk_ns, WK_ADDR, "b", "false"))
    procs = []
    try:
        for ns, addr, name, host in nodes:
            cmd = [
                "ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{PS_ADDR}:29400", "--rdzv-id", "netns-test",
                "--local-addr", addr, "--rdzv-conf", f"is_host={host}",
                "-m", "wavelet.scripts.cli", "run", "--shards-per-node", "1",
                "--curve-keys", str(keys), "--transport", "tcp", "--run-dir", str(tmp_path / name),
                "--epochs", "20",  # 4 waves over TCP: a little more room above the bar
            ]  # fmt: skip
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
            procs.append(
                (
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=CHILD_ENV,
                        start_new_session=True,
                    ),
                    log,
                )
            )
        for (proc, _log), (_, _, name, _) in zip(procs, nodes, strict=True):
            assert proc.wait(200) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        summary = json.loads((tmp_path / "a" / "summary.json").read_text())
        assert summary["test_accuracy"] >= 0.97, summary
        assert set(summary["waves"]) == {"w0/0", "w0/1", "w1/0", "w1/1"}
        assert all(w["transport"] == "tcp" for w in summary["waves"].values())
        # node a's summary counts node b's worker too (its records are on node b)
        both = record_samples(tmp_path / "a") + record_samples(tmp_path / "b")
        assert summary["samples"] == both and "2 workers" in summary["throughput_of"], summary
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            log.close()
