"""Daemons forked from the job's fork server (scripts/forkserver.py) are processes of their own:
their command, log, working directory and session; their exit status as Popen reports it; and
none outlives a launcher killed with SIGKILL, forked or exec'd."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CHILD_ENV, ONE_SHARD, descendants, wait_for, wavelet_cmd
from helpers import processes_mentioning

from wavelet.scripts.forkserver import ForkServer


@pytest.fixture
def server(tmp_path):
    server = ForkServer.start(tmp_path / "forkserver.log", env=CHILD_ENV)
    yield server
    server.close()
    assert server.proc.returncode == 0  # it ends when the launcher's end of its socket closes


@pytest.mark.timeout(120)
def test_a_forked_command_runs_in_its_working_directory_and_reports_its_status(
    tmp_path, server, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    done = server.spawn(["keys", "alice", "--out", "k"], CHILD_ENV, tmp_path / "a.log", False)
    assert done.wait(60) == 0, (tmp_path / "a.log").read_text()
    assert (tmp_path / "k" / "alice.key").exists()  # relative to the launcher's directory
    assert "alice" in (tmp_path / "a.log").read_text()

    refused = server.spawn(["ps", "--staleness", "-3"], CHILD_ENV, tmp_path / "b.log", False)
    assert refused.wait(60) == 2  # a usage error, as from the command line
    assert "wavelet: error" in (tmp_path / "b.log").read_text()
    # a restart appends to the log it had
    again = server.spawn(["ps", "--staleness", "-3"], CHILD_ENV, tmp_path / "b.log", True)
    assert again.wait(60) == 2
    assert (tmp_path / "b.log").read_text().count("wavelet: error") == 2


@pytest.mark.timeout(120)
def test_a_forked_shard_shows_its_own_command_and_session_and_dies_by_signal(tmp_path, server):
    ready = tmp_path / "ps-0.addr"
    args = ["ps", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready)]
    shard = server.spawn([*args, "--run-dir", str(tmp_path)], CHILD_ENV, tmp_path / "ps.log", False)
    try:
        wait_for(lambda: ready.exists() or shard.poll() is not None, 60, "the shard's address")
        assert shard.poll() is None, (tmp_path / "ps.log").read_text()
        assert os.getsid(shard.pid) == shard.pid  # its own session: Ctrl-C reaches the launcher
        command = Path(f"/proc/{shard.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert "wavelet.scripts.cli ps" in command and str(ready) in command
        assert shard.pid in processes_mentioning(str(ready))
        shard.kill()
        assert shard.wait(30) == -signal.SIGKILL
    finally:
        shard.kill()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_a_launcher_killed_with_sigkill_leaves_no_daemon(tmp_path, spawn):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        wavelet_cmd("launch", "--epochs", "200", *ONE_SHARD, "--run-dir", str(run_dir))
        + ["--spawn", spawn],
        env=CHILD_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: any((run_dir / "records").glob("*")), 120, "the worker's records")
        daemons = [p for p in processes_mentioning(str(run_dir)) if p != launcher.pid]
        assert len(daemons) >= 2, daemons  # the shard and the worker
        started = descendants(launcher.pid)  # and the fork server, where there is one
        assert set(daemons) <= set(started)
        server_logs = [
            Path(command.split()[-1])
            for command in map(_command, started)
            if "wavelet.scripts.forkserver" in command
        ]
        assert len(server_logs) == (spawn == "fork"), server_logs
        launcher.kill()
        launcher.wait(10)
        wait_for(lambda: not [p for p in started if _exists(p)], 60, "processes left behind")
        assert not [log for log in server_logs if log.exists()]  # its empty temporary log
    finally:
        launcher.kill()
        launcher.wait(10)


def _exists(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; its new parent has yet to reap it


def _command(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


FORKED_HERE = """
import os, sys
from pathlib import Path
from wavelet.scripts.forkserver import ForkServer

out = Path(sys.argv[1])
server = ForkServer.fork_here(out / "server.log")
stat = Path(f"/proc/{server.proc.pid}/stat").read_text()
print("server's parent:", int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid())
keys = ["keys", "alice", "--out", str(out / "k")]
child = server.spawn(keys, dict(os.environ), out / "a.log", False)
print("child status:", child.wait(60))
# retitled before it served: read now, not as soon as it was forked
title = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().replace(bytes(1), b" ")
print("server title:", title.decode().split()[1:3])
server.close()
print("server status:", server.proc.returncode)
"""


@pytest.mark.timeout(120)
def test_a_server_forked_from_the_command_itself_serves_and_leaves_as_python_does(tmp_path):
    """``fork_here`` (how the CLI starts its jobs' server): the server and its children leave
    through the caller's frames by SystemExit, so the caller's code after the fork runs once."""
    done = subprocess.run(
        [sys.executable, "-c", FORKED_HERE, str(tmp_path)],
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "server's parent: True",
        "child status: 0",
        "server title: ['-m', 'wavelet.scripts.forkserver_serve']",
        "server status: 0",
    ], done.stdout + done.stderr
    assert (tmp_path / "k" / "alice.key").exists()
    assert "alice" in (tmp_path / "a.log").read_text()
    assert (tmp_path / "server.log").read_text() == ""  # nothing went wrong in the server
