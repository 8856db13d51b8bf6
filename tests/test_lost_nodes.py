"""A node that goes never hangs the job: a lost shard ends the waves within the shard timeout,
naming what was lost; a stopped worker says goodbye (nobody waits for its lease); the training
budget holds while the shards hold a wave back; a process of a torchrun job dies with its agent."""

import signal
import subprocess
import sys

import pytest
from conftest import CHILD_ENV, forked, kill_tree, wait_for

from wavelet.common.records import read_records

JOB = ["--epochs", "500", "--set", "heartbeat_s=0.5"]


def _worker_args(daemons, run_dir, *extra, rank=0, workers=1, waves=1):
    args = ["worker", *JOB, "--rank", str(rank), "--num-workers", str(workers), "--threads", "1"]
    args += ["--run-dir", str(run_dir), "--waves", str(waves), *extra]
    args += ["--shards", str(len(daemons.addresses))]
    for a in daemons.addresses:
        args += ["--shard", a]
    return args


def _steps(path):
    return [r for r in read_records(path) if r["kind"] == "step"] if path.exists() else []


@pytest.mark.timeout(180)
def test_a_lost_shard_ends_the_wave_within_the_shard_timeout_naming_it(shard_daemons, tmp_path):
    daemons = shard_daemons([*JOB, "--staleness", "inf", "--waves", "1"], count=2)
    records = tmp_path / "run" / "records" / "worker-0-wave-0.jsonl"
    log = tmp_path / "worker.log"
    args = _worker_args(daemons, tmp_path / "run", "--set", "shard_timeout_s=3", "--waves", "1")
    with forked(args, log) as worker:
        wait_for(lambda: len(_steps(records)) >= 5, 90, "training did not start")
        daemons.procs[1].send_signal(signal.SIGKILL)
        daemons.procs[1].wait(10)
        code = worker.wait(90)  # the shard timeout (3 s), not the request timeout (300 s)
    text = log.read_text()
    assert code == 1, text[-2000:]
    assert f"shard 1 at {daemons.addresses[1]} is gone" in text, text[-2000:]
    assert "it has no standby" in text and "the job cannot go on" in text


@pytest.mark.timeout(180)
def test_a_stopped_worker_leaves_at_once_and_the_other_goes_on(shard_daemons, tmp_path):
    """SIGTERM (a preemption notice): the worker leaves the shards on its way out, so the other
    worker's synchronous steps go on without waiting for its lease (an hour here)."""
    job = [*JOB, "--staleness", "0", "--waves", "1", "--set", "wave_timeout_s=3600"]
    daemons = shard_daemons(job, count=1, expect_waves=2)
    a_records = tmp_path / "a" / "records" / "worker-0-wave-0.jsonl"
    b_records = tmp_path / "b" / "records" / "worker-1-wave-0.jsonl"
    common = ["--staleness", "0", "--set", "wave_timeout_s=3600"]
    a_args = _worker_args(daemons, tmp_path / "a", *common, rank=0, workers=2)
    b_args = _worker_args(daemons, tmp_path / "b", *common, rank=1, workers=2)
    with forked(a_args, tmp_path / "a.log") as a, forked(b_args, tmp_path / "b.log") as b:
        wait_for(lambda: len(_steps(b_records)) >= 5, 90, "training did not start")
        b.send_signal(signal.SIGTERM)
        assert b.wait(30) == 0, (tmp_path / "b.log").read_text()[-2000:]
        at_stop = len(_steps(a_records))
        wait_for(
            lambda: len(_steps(a_records)) > at_stop + 10,
            90,
            "a did not go on alone after b was stopped",
        )
        a.send_signal(signal.SIGTERM)
        assert a.wait(30) == 0
    shard_log = (daemons.tmp / "ps-0.log").read_text()
    assert "wave w1/0 left at clock" in shard_log
    assert "silent for over" not in shard_log


@pytest.mark.timeout(180)
def test_the_budget_holds_while_the_shards_hold_a_wave_back(shard_daemons, tmp_path):
    """Bulk-synchronous with the other worker stopped (SIGSTOP: its connections stay open, and
    with hour-long leases the shard waits an hour for it): the first wave's pull waits for it,
    and its --max-seconds ends that wait."""
    common = ["--staleness", "0", "--set", "wave_timeout_s=3600", "--set", "shard_timeout_s=3600"]
    daemons = shard_daemons([*JOB, *common, "--waves", "1"], count=1, expect_waves=2)
    a_records = tmp_path / "a" / "records" / "worker-0-wave-0.jsonl"
    b_records = tmp_path / "b" / "records" / "worker-1-wave-0.jsonl"
    a_args = _worker_args(daemons, tmp_path / "a", *common, "--max-seconds", "20", workers=2)
    a_args[a_args.index("--epochs") + 1] = "0"
    b_args = _worker_args(daemons, tmp_path / "b", *common, rank=1, workers=2)
    with forked(b_args, tmp_path / "b.log") as b, forked(a_args, tmp_path / "a.log") as a:
        # both: a records a step as its reply comes, b the same step a moment later
        started = lambda: len(_steps(a_records)) >= 3 and len(_steps(b_records)) >= 3
        wait_for(started, 90, "training did not start")
        b.send_signal(signal.SIGSTOP)
        try:
            code = a.wait(120)
        finally:
            b.send_signal(signal.SIGCONT)
        text = (tmp_path / "a.log").read_text()
        assert code == 0, text[-2000:]
        assert "the budget ended while it waited for the shards" in text
        b.send_signal(signal.SIGTERM)
        b.wait(30)
    assert len(_steps(b_records)) >= 3


@pytest.mark.timeout(120)
def test_a_torchrun_process_stops_when_its_agent_is_gone(tmp_path):
    """``wavelet run`` under an agent killed with SIGKILL (its workers live in sessions of their
    own, out of reach of a killed process group) stops by itself instead of training on."""
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "p = subprocess.Popen(sys.argv[1:], start_new_session=True)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n",
            sys.executable,
            "-m",
            "wavelet.scripts.cli",
            "run",
            "--mode",
            "allreduce",
            "--epochs",
            "1000",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        env={
            **CHILD_ENV,
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        child = int(agent.stdout.readline())
        records = tmp_path / "run" / "records"
        wait_for(lambda: any(records.glob("*.jsonl")), 90, "the rank did not start training")
        agent.kill()
        agent.wait(10)
        wait_for(lambda: not _alive(child), 60, "the rank outlived its agent")
    finally:
        if agent.poll() is None:
            agent.kill()
        if child is not None and _alive(child):
            kill_tree(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _free_port() -> int:
    from helpers import free_port

    return free_port()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_worker_costs_the_other_no_step(shard_daemons, tmp_path):
    """Wave turns across two workers (each wave waits for the other's update), and worker b
    killed with SIGKILL: a finishes its epochs, every step of them, exit 0. Equal batches: the
    faster wave would otherwise take more samples a step, and fewer steps (ps/balance.py)."""
    common = ["--updates", "wave-turns", "--balance-batches", "off"]
    job = [*JOB, *common, "--waves", "1"]
    daemons = shard_daemons([*job, "--epochs", "4"], count=1, expect_waves=2)
    a_records = tmp_path / "a" / "records" / "worker-0-wave-0.jsonl"
    b_records = tmp_path / "b" / "records" / "worker-1-wave-0.jsonl"
    a_args = _worker_args(daemons, tmp_path / "a", *common, workers=2)
    a_args[a_args.index("--epochs") + 1] = "4"
    b_args = _worker_args(daemons, tmp_path / "b", *common, rank=1, workers=2)
    with forked(b_args, tmp_path / "b.log") as b, forked(a_args, tmp_path / "a.log") as a:
        wait_for(lambda: len(_steps(b_records)) >= 5, 90, "training did not start")
        b.send_signal(signal.SIGKILL)
        code = a.wait(150)
    assert code == 0, (tmp_path / "a.log").read_text()[-2000:]
    steps = _steps(a_records)
    per_epoch = next(r for r in read_records(a_records) if r["kind"] == "start")["steps_per_epoch"]
    assert len(steps) == 4 * per_epoch and steps[-1]["clock"] == 4 * per_epoch - 1
