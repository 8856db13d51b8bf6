"""Membership: a worker killed with SIGKILL leaves at once (its connections close) so the others go
on (under s = 0 and a finite s); started again, it rejoins at the current version. A wave that
goes silent with its connection open is dropped after the wave timeout; a shard that did not run
does not drop the waves whose heartbeats it could not read."""

import signal
import time

import pytest
import zmq
from conftest import forked, wait_for
from helpers import TIMEOUT_S, client_for, tiny_model

from wavelet.common.records import read_records
from wavelet.worker.heartbeat import Heartbeat

# The wave timeout is short so that a killed worker is dropped soon, but not so short that a
# worker starved of CPU while it registers is dropped before it starts: one core shared by two
# test processes put 4 s between a wave's register and its next request once, and 6.7 s with
# no heartbeat counted in between (a fresh clone pinned to one core on a slow day; 6 s was the
# timeout then).
JOB = ["--epochs", "500", "--set", "wave_timeout_s=15", "--set", "heartbeat_s=0.5"]


def _worker_args(daemons, rank, run_dir, s):
    args = [
        "worker",
        *JOB,
        "--staleness",
        s,
        "--rank",
        str(rank),
        "--num-workers",
        "2",
        "--threads",
        "1",
        "--run-dir",
        str(run_dir),
        "--waves",
        "1",
    ]
    for a in daemons.addresses:
        args += ["--shard", a]
    return args


def _steps(path):
    return [r for r in read_records(path) if r["kind"] == "step"] if path.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("s", ["0", "2"])
def test_killed_worker_is_dropped_and_rejoins(shard_daemons, tmp_path, s):
    daemons = shard_daemons([*JOB, "--staleness", s, "--waves", "1"], count=2, expect_waves=2)
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    a_records = run_a / "records" / "worker-0-wave-0.jsonl"
    with forked(_worker_args(daemons, 0, run_a, s), tmp_path / "a.log") as a:
        with forked(_worker_args(daemons, 1, run_b, s), tmp_path / "b.log") as b:
            deadline = time.monotonic() + 60
            while len(_steps(a_records)) < 20:
                assert time.monotonic() < deadline, "training did not start"
                time.sleep(0.1)
            b.send_signal(signal.SIGKILL)
            b.wait(10)
        at_kill = len(_steps(a_records))
        # b's connections closed with it and the shards dropped it: a goes on alone
        wait_for(
            lambda: len(_steps(a_records)) > at_kill + 10,
            120,
            "a did not go on alone after b was killed",
        )
        alone = len(_steps(a_records))
        # b comes back as a new process and joins at the current clock
        b2_records = tmp_path / "b2" / "records" / "worker-1-wave-0.jsonl"
        with forked(_worker_args(daemons, 1, tmp_path / "b2", s), tmp_path / "b2.log") as b2:
            deadline = time.monotonic() + 60
            while len(_steps(b2_records)) < 10:
                assert time.monotonic() < deadline, (tmp_path / "b2.log").read_text()[-2000:]
                time.sleep(0.1)
            # both train together again: each advances
            a_then, b_then = len(_steps(a_records)), len(_steps(b2_records))
            wait_for(
                lambda: len(_steps(a_records)) > a_then and len(_steps(b2_records)) > b_then,
                120,
                "a and b2 did not both advance",
            )
            b2.send_signal(signal.SIGTERM)
            assert b2.wait(30) == 0
        a.send_signal(signal.SIGTERM)
        assert a.wait(30) == 0, (tmp_path / "a.log").read_text()[-2000:]
    rejoined = _steps(b2_records)
    assert rejoined[0]["clock"] > alone // 2, "b should rejoin at the current clock"
    logs = "".join((daemons.tmp / f"ps-{i}.log").read_text() for i in range(2))
    assert "w1/0: its connection closed; it leaves the membership" in logs
    assert "silent for over" not in logs  # nobody waited for the lease


@pytest.mark.timeout(120)
def test_a_stopped_shard_does_not_count_its_own_stall_as_silence(shard_daemons):
    """A shard that did not run (here SIGSTOPped past the wave timeout) cannot have read the
    heartbeats queued meanwhile: on waking, its timers must not drop the waves that sent them.
    A wave that really goes silent is still dropped afterwards."""
    daemons = shard_daemons(["--staleness", "inf", "--set", "wave_timeout_s=3"], count=1)
    shard = daemons.procs[0]
    c = client_for(tiny_model(), daemons.addresses)
    beat = Heartbeat(daemons.addresses, "w0", lambda: [0], 0.2, zmq.Context.instance())
    try:
        c.register(0)
        beat.start()
        shard.send_signal(signal.SIGSTOP)
        try:
            time.sleep(6)  # twice the wave timeout, heartbeats queued all along
        finally:
            shard.send_signal(signal.SIGCONT)
        # the shard's first turn after waking runs its timers before it answers this
        assert c.stats()[0]["waves"]["w0/0"]["live"], "a wave that heartbeat was dropped"
        time.sleep(1)  # several more timer turns
        assert c.stats()[0]["waves"]["w0/0"]["live"]
        beat.stop()
        beat.join(TIMEOUT_S)
        wait_for(
            lambda: not c.stats()[0]["waves"]["w0/0"]["live"],
            60,
            "a wave silent past the timeout was not dropped",
        )
    finally:
        beat.stop()
        shard.send_signal(signal.SIGCONT)
        c.close()
    assert "did not run for" in (daemons.tmp / "ps-0.log").read_text()


def test_the_summary_names_membership_changes_only_beyond_each_wave_joining_and_leaving_once():
    from wavelet.scripts.report import format_summary

    row = {"clock": 5, "pushes": 10, "hist": {"0": 10}, "parked": 0, "parked_s": 0.0}
    row |= {"last_read": {"0": 10}, "rejected": 0, "dropped": 0, "skipped": 0}
    row |= {"transport": "shm", "staleness_mean": 0.0, "staleness_max": 0, "staleness_p99": 0}
    summary = {
        "run_dir": "runs/x",
        "test_accuracy": 0.9,
        "samples": 100,
        "train_seconds": 1.0,
        "samples_per_s": 100.0,
        "precision": "fp32",
        "wire_dtype": "fp32",
        "wire_bytes": 0,
        "waves": {name: dict(row) for name in ("w0/0", "w0/1")},
    }
    # every wave joined at the start and left when done: nothing to say
    quiet = {**summary, "membership": {"epoch": 4, "joins": 2, "leaves": 2}}
    assert "membership" not in format_summary(quiet)
    # a wave re-joined after it was dropped: said, with the job's count of waves
    rejoined = {**summary, "membership": {"epoch": 6, "joins": 3, "leaves": 3}}
    assert "membership: 3 join(s) and 3 leave(s) of the job's 2 waves" in format_summary(rejoined)
    lost = {**quiet, "workers_lost": 1}
    assert "1 worker(s) lost with their node" in format_summary(lost)
