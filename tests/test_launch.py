"""The launcher and daemons as a user runs them: the default job end to end, Ctrl-C, a child that
dies, SIGTERM to each daemon; nothing is left running afterwards."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    between_checkpoints,
    forked,
    kill_tree,
    run_wavelet,
    started,
    wait_for,
    wavelet_cmd,
)
from helpers import processes_mentioning

from wavelet.common import shm
from wavelet.common.records import last_record, new_run_dir, read_records
from wavelet.ps.checkpoints import read_checkpoint
from wavelet.scripts.report import Progress


def _shard_marker(run_dir: Path, index: int) -> bytes:
    """What only shard ``index``'s command line holds: the file it writes its address to (the
    workers' name it too, as the file they read)."""
    return b"--ready-file " + str(run_dir / f"ps-{index}.addr").encode()


def _one_process(run_dir: Path, marker: bytes) -> int:
    """The pid of the job's one process whose command line (space-separated, as a forked
    daemon shows it) holds ``marker``."""
    found = [
        p
        for p in processes_mentioning(str(run_dir))
        if marker in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")
    ]
    assert len(found) == 1, found
    return found[0]


def _assert_nothing_left(run_dir: Path):
    wait_for(lambda: not processes_mentioning(str(run_dir)), 15, "daemons left behind")
    left = list(shm.SHM_DIR.glob(shm.run_prefix(run_dir) + "*"))
    assert not left, f"shared-memory segments left behind: {left}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_default_job_reaches_the_accuracy_bar(tmp_path):
    run_dir = tmp_path / "run"
    # The default job, exactly as the README runs it (it is small: about 5 s of training).
    done = run_wavelet("launch", "--run-dir", str(run_dir), timeout=200, by_hand=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "final test accuracy" in done.stdout and "samples/s" in done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.97, summary
    assert set(summary["waves"]) == {"w0/0", "w0/1"}
    # updates = auto on a CPU worker: the waves take strict turns, so nothing is stale
    assert json.loads((run_dir / "job.json").read_text())["updates"] == "wave-turns"
    assert "wave-turns" in done.stdout.splitlines()[0]
    for w in summary["waves"].values():
        assert w["pushes"] > 0 and w["staleness_mean"] == 0
        assert w["transport"] == "shm"  # shards and worker share this host
    pushes = list(read_records(run_dir / "records" / "ps-0-pushes.jsonl"))
    # every push tells its own step's batch and compute, the first too: a push that leaves
    # during backward tells the compute so far (balanced batches follow it a step sooner)
    assert pushes and all(p["compute_samples"] == p["samples"] > 0 for p in pushes), pushes[:3]
    assert all(p["compute_s"] > 0 for p in pushes), pushes[:3]
    assert (run_dir / "staleness.png").read_bytes()[:4] == b"\x89PNG"
    _assert_nothing_left(run_dir)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_launcher(tmp_path, *extra, ignore_sigint=False):
    run_dir = tmp_path / "run"
    cm = started(
        wavelet_cmd("launch", "--run-dir", str(run_dir), "--epochs", "200", *extra),
        tmp_path / "launch.log",
        **({"preexec_fn": _ignore_sigint} if ignore_sigint else {}),
    )
    proc = cm.__enter__()
    step_file = run_dir / "records" / "worker-0-wave-1.jsonl"
    wait_for(
        lambda: step_file.exists() and step_file.stat().st_size > 2000, 90, "training did not start"
    )
    return cm, proc, run_dir


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_tears_the_job_down(tmp_path):
    # started with SIGINT ignored, as a script's background job is: Ctrl-C must still work
    cm, proc, run_dir = _start_launcher(tmp_path, ignore_sigint=True)
    try:
        assert len(processes_mentioning(str(run_dir))) >= 4  # launcher, 2 shards, worker
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        _assert_nothing_left(run_dir)
    finally:
        cm.__exit__(None, None, None)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_second_ctrl_c_while_the_job_stops_kills_what_is_left_and_still_cleans_up(tmp_path):
    """An impatient second Ctrl-C during the teardown: the job's processes that have not
    stopped yet are killed at once, and the teardown still ends (no traceback; nothing left).
    A stopped worker stands for one that is slow to stop: it cannot act on its SIGTERM, so the
    teardown is sure to be waiting for it when the second Ctrl-C comes."""
    cm, proc, run_dir = _start_launcher(tmp_path)
    log = tmp_path / "launch.log"
    worker = None
    try:
        worker = _one_process(run_dir, b"worker")
        os.kill(worker, signal.SIGSTOP)
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "interrupted: stopping the job" in log.read_text(), 30, "no first stop")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        out = log.read_text()
        assert "Traceback" not in out, out[-3000:]
        assert "stopping now: killing what is left of the job" in out, out[-3000:]
        _assert_nothing_left(run_dir)  # before: the stopped worker outlived the launcher
    finally:
        cm.__exit__(None, None, None)
        if worker is not None and worker in processes_mentioning(str(run_dir)):  # left, stopped
            os.kill(worker, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_dying_child_stops_the_job_and_is_reported(tmp_path):
    cm, proc, run_dir = _start_launcher(tmp_path)
    try:
        os.kill(_one_process(run_dir, b"worker"), signal.SIGKILL)
        assert proc.wait(30) == 1
        log = (tmp_path / "launch.log").read_text()
        assert "worker-0 exited with status -9" in log
        _assert_nothing_left(run_dir)
    finally:
        cm.__exit__(None, None, None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_daemons_stop_cleanly_on_signals(tmp_path, shard_daemons, sig):
    daemons = shard_daemons([], count=2, expect_waves=2, by_hand=True)
    cmd = wavelet_cmd(
        "worker", "--epochs", "200", "--threads", "1", "--run-dir", str(tmp_path / "run")
    )
    for a in daemons.addresses:
        cmd += ["--shard", a]
    with started(cmd, tmp_path / "worker.log") as worker:
        step_file = tmp_path / "run" / "records" / "worker-0-wave-0.jsonl"
        wait_for(
            lambda: step_file.exists() and step_file.stat().st_size > 2000,
            60,
            "worker did not train",
        )
        worker.send_signal(sig)
        assert worker.wait(30) == 0, (tmp_path / "worker.log").read_text()[-2000:]
    for p in daemons.procs:
        p.send_signal(sig)
        assert p.wait(15) == 0
        kill_tree(p.pid)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_job_stopped_by_ctrl_c_and_then_by_a_killed_shard_resumes_each_time(tmp_path):
    """One job stopped twice (one job, not two, because a launch costs more than its training
    here): by Ctrl-C, when the shards checkpoint as they stop and nothing is lost, and by a shard
    killed between checkpoints, when what it applied since is lost and counted. Resumed each
    time, it ends at its full budget."""
    run_dir = tmp_path / "run"
    records = run_dir / "records" / "worker-0-wave-0.jsonl"
    first = "launch", "--run-dir", str(run_dir), "--epochs", "10", "--checkpoint-every", "60"
    with forked(first, tmp_path / "first.log") as proc:
        wait_for(
            lambda: records.exists() and records.stat().st_size > 80_000,  # about 80 of 220 steps
            90,
            "training did not start",
        )
        proc.send_signal(signal.SIGINT)  # the shards checkpoint as they stop
        assert proc.wait(30) == 130
    stopped_at = max(r["clock"] for r in read_records(records) if r["kind"] == "step")

    with forked(["launch", "--resume", str(run_dir)], tmp_path / "second.log") as proc:
        wait_for(lambda: between_checkpoints(run_dir), 120, "no updates after a checkpoint")
        os.kill(_one_process(run_dir, _shard_marker(run_dir, 0)), signal.SIGKILL)
        assert proc.wait(30) == 1
    log = (tmp_path / "second.log").read_text()
    assert "ps-0 exited with status -9" in log
    assert f"wavelet launch --resume {run_dir}" in log
    _assert_nothing_left(run_dir)
    # what the killed shard applied after its last checkpoint is lost; the other stopped cleanly
    logged = last_record(run_dir / "records" / "ps-0-pushes.jsonl")["version"]
    kept = read_checkpoint(run_dir / "checkpoints" / "shard-0.pt")["version"]
    assert logged > kept

    done = run_wavelet("launch", "--resume", str(run_dir), timeout=200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = list(read_records(records))
    starts = [i for i, r in enumerate(rows) if r["kind"] == "start"]
    assert len(starts) == 3
    first_resumed = next(r["clock"] for r in rows[starts[1] :] if r["kind"] == "step")
    # after Ctrl-C the job goes on where it stopped (the shards checkpoint as they stop), not
    # from clock 0 (+2: a wave may have pushed its last step, and the shard counted it, without
    # having written that step's record when it was stopped)
    assert stopped_at - 60 <= first_resumed <= stopped_at + 2, (first_resumed, stopped_at)
    assert max(r["clock"] for r in rows if r["kind"] == "step") == 10 * 22 - 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.95, summary
    assert summary["lost_updates"] == logged - kept
    assert f"lost {logged - kept} update(s)" in done.stdout
    # wave turns resume with the group whose turn it was: no baton waits for the other one
    assert "stalled" not in (run_dir / "logs" / "worker-0.log").read_text()
    _assert_nothing_left(run_dir)


def test_runs_started_in_the_same_second_get_run_dirs_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261202-101342")  # one second for all
    made: list[Path] = []
    threads = [
        threading.Thread(target=lambda: made.append(new_run_dir(root=tmp_path))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(p.name for p in made) == sorted(
        ["20261202-101342"] + [f"20261202-101342-{n}" for n in range(2, 9)]
    )
    assert all(p.is_dir() and not any(p.iterdir()) for p in made)
    assert new_run_dir("compare", root=tmp_path).name == "compare-20261202-101342"


def test_progress_shows_a_dash_until_there_is_a_number(tmp_path):
    line = Progress(tmp_path, epochs=15).line(0.0)
    assert "loss -  - samples/s" in line and "nan" not in line


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launch_restarts_a_killed_shard_and_the_job_finishes(tmp_path):
    cm, proc, run_dir = _start_launcher(
        tmp_path, "--epochs", "12", "--checkpoint-every", "60", "--max-restarts", "1"
    )
    try:
        wait_for(lambda: between_checkpoints(run_dir), 120, "no updates after a checkpoint")
        os.kill(_one_process(run_dir, _shard_marker(run_dir, 0)), signal.SIGKILL)
        assert proc.wait(200) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    finally:
        cm.__exit__(None, None, None)
    log = (tmp_path / "launch.log").read_text()
    assert "ps-0 exited with status -9: restarting it (1/1 restarts)" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.95, summary
    assert summary["lost_updates"] > 0  # what the shard applied after its checkpoint
    assert "restored version" in (run_dir / "logs" / "ps-0.log").read_text()
    _assert_nothing_left(run_dir)
