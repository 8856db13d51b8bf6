"""Supervision of a job's child processes: spawn them, restart the ones that die (up to a
budget), report the first failure, and tear everything down (SIGTERM, a grace period, SIGKILL).

Every child gets SIGTERM if the launcher itself dies (``PR_SET_PDEATHSIG``), so no daemon is
orphaned, and its own session, so a Ctrl-C reaches the launcher alone. Children are forked from
the job's fork server (``scripts/forkserver.py``) unless ``spawn = "exec"`` or the server could
not start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from wavelet.common.daemon_config import LaunchConfig
from wavelet.common.security import JobKeys
from wavelet.common.shm import remove_segments, run_prefix
from wavelet.scripts.forkserver import ForkedChild, ForkServer, ForkServerError, die_with_parent

STOP_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen | ForkedChild
    log: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    address: str = ""  # a shard's bound address: a restarted shard binds it again

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


USAGE_ERROR = 2  # how a daemon exits when it refuses its settings (one line on stderr)


class ChildFailed(RuntimeError):
    def __init__(self, child: Child, code: int | None, hint: str = ""):
        self.child = child
        what = "did not start in time" if code is None else f"exited with status {code}"
        super().__init__(
            f"{child.name} {what}; last lines of {child.log}:\n{child.tail()}"
            + (f"\n{hint}" if hint else "")
        )


class ChildDidNotStart(ChildFailed):
    """A daemon refused to start (a port in use, a bad setting): its own one line says why, and
    nothing ran that a resume could go on from."""

    def __init__(self, child: Child, code: int):
        self.child = child
        RuntimeError.__init__(self, f"{child.name} could not start: {_refusal(child)}")


def _refusal(child: Child) -> str:
    """The daemon's own line saying why it refused to start; what a library printed while the
    process went down after it (a ZeroMQ assertion at exit) is not the reason."""
    lines = [line.strip() for line in child.tail(5).splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("wavelet: error:")]
    return (said or lines or ["(no log)"])[-1]


def start_fork_server(spawn: str) -> ForkServer | None:
    """A fork server, its imports started now, for one job (``Job`` takes it, or starts one
    itself at its first spawn) or several (``launch(fork_server=...)``: compare's modes); None
    under ``spawn = "exec"``."""
    if spawn != "fork":
        return None
    return ForkServer.start(wait=False)


@contextmanager
def shared_fork_server(spawn: str, given: ForkServer | None = None):
    """One fork server for several jobs (compare's modes, tune's settings: its imports paid
    once): ``given``, which its caller closes, or one started now and closed after."""
    if spawn != "fork" or given is not None:
        yield given if spawn == "fork" else None
        return
    server = ForkServer.start(wait=False)
    try:
        yield server
    finally:
        server.close()


@dataclass
class Job:
    config: LaunchConfig
    run_dir: Path
    keys: JobKeys | None = None
    admin_token: str = ""
    children: list[Child] = field(default_factory=list)
    restarts: int = 0
    cap = None  # --slow-device: the CpuCap of one device's processes, removed at teardown
    # children that may die without a restart or a failure: shards whose standby takes over
    expendable: set[str] = field(default_factory=set)
    _noted: set[str] = field(default_factory=set, repr=False)
    _server: ForkServer | None = field(default=None, repr=False)
    _owns_server: bool = True  # else the caller's, for several jobs: left running at teardown
    _no_fork_server: bool = False
    _hurry: _Hurry | None = field(default=None, repr=False)

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        child = Child(name, self._popen(args, env or {}, log, "wb"), log, args, env or {})
        self.children.append(child)
        return child

    def _popen(self, args: list[str], env: dict[str, str], log: Path, mode: str):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        if server := self._fork_server():
            try:
                return server.spawn(args, env, log, append=mode == "ab")
            except ForkServerError as e:
                print(
                    f"warning: {e}; starting daemons with exec from now on (--spawn exec)",
                    file=sys.stderr,
                )
                self._drop_fork_server()
        with open(log, mode) as out:
            return subprocess.Popen(
                [sys.executable, "-m", "wavelet.scripts.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
                env=env,
            )

    def _fork_server(self) -> ForkServer | None:
        if self.config.spawn != "fork" or self._no_fork_server:
            return None
        if self._server is None:
            self._server = start_fork_server(self.config.spawn)
            self._owns_server = True
        return self._server

    def _drop_fork_server(self) -> None:
        self._no_fork_server = True
        if self._server is not None and self._owns_server:
            self._server.close()
        self._server = None

    def all_running(self) -> bool:
        return all(c.proc.poll() is None for c in self.children)

    def supervise(self, allow_exit: tuple[Child, ...] = (), say=print) -> None:
        """Restart a child that died, up to ``max_restarts`` in all; else raise ChildFailed."""
        for c in self.children:
            code = c.proc.poll()
            if code is None or (code == 0 and c in allow_exit):
                continue
            if c.name in self.expendable and code != USAGE_ERROR:
                if c.name not in self._noted:  # a shard whose standby takes over
                    self._noted.add(c.name)
                    say(f"{c.name} exited with status {code}: its standby takes it over")
                continue
            if self.restarts >= self.config.max_restarts or code == USAGE_ERROR:
                self.check(allow_exit)
            self.restart(c, code, say)

    def restart(self, child: Child, code: int, say=print) -> None:
        """Start a dead child again: a shard on the address it had (it restores its last
        checkpoint and the waves re-join it), a worker with --resume (from the shards' clocks)."""
        self.restarts += 1
        args = list(child.args)
        if child.address:  # its flags omit what is the default, --bind included
            if "--bind" in args:
                args[args.index("--bind") + 1] = child.address
            else:
                args += ["--bind", child.address]
        elif "--resume" not in args:
            args.append("--resume")
        say(
            f"{child.name} exited with status {code}: restarting it "
            f"({self.restarts}/{self.config.max_restarts} restarts)"
        )
        with open(child.log, "ab") as out:
            out.write(f"\n--- restart {self.restarts} after status {code} ---\n".encode())
        child.proc = self._popen(args, child.env, child.log, "ab")

    def check(self, allow_exit: tuple[Child, ...] = ()) -> None:
        for c in self.children:
            code = c.proc.poll()
            if code == USAGE_ERROR:  # a setting it refused: its one line says which
                raise ChildDidNotStart(c, code)
            if c.name in self.expendable:
                continue
            if code is not None and (code != 0 or c not in allow_exit):
                raise ChildFailed(c, code, self.resume_hint() if c.name.startswith("ps-") else "")

    def resume_hint(self) -> str:
        if any((self.run_dir / "checkpoints").glob("shard-*.pt")):
            return (
                f"the job stopped; go on from the shards' last checkpoints with: "
                f"wavelet launch --resume {self.run_dir}"
            )
        return (
            "the job stopped before any shard checkpoint was written; start it again, with "
            "--checkpoint-every N to be able to resume next time"
        )

    def stopping(self) -> None:
        """The job is being stopped (a Ctrl-C came, or it is done): from now until the teardown
        ends, a Ctrl-C (or SIGTERM) hurries it instead of raising in the middle of it, which
        had left a traceback, a child slow to stop running after the launcher, and the
        segments and a --slow-device cgroup behind."""
        if self._hurry is None:
            self._hurry = _Hurry()
            self._hurry.install()

    def teardown(self) -> bool:
        """SIGTERM every child still running, wait, then SIGKILL what is left; then remove the
        shared-memory segments a killed shard could not. A stop signal meanwhile kills what is
        left at once (``stopping``); returns whether one came."""
        self.stopping()
        hurry = self._hurry
        try:
            alive = [c for c in self.children if c.proc.poll() is None]
            for c in alive:
                c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for c in alive:
                while not hurry.now and time.monotonic() < deadline:
                    try:
                        c.proc.wait(min(0.2, max(0.01, deadline - time.monotonic())))
                        break
                    except subprocess.TimeoutExpired:
                        continue
                if c.proc.poll() is None:
                    c.proc.kill()
                    c.proc.wait()
            self._release()
        finally:
            hurry.restore()
            self._hurry = None
        return hurry.now

    def _release(self) -> None:
        """What the job held besides its processes: the fork server, the cap, the segments."""
        if self._server is not None and self._owns_server:
            self._server.close()
        self._server = None
        if self.cap is not None:
            self.cap.close()
            self.cap = None
        remove_segments(run_prefix(self.run_dir))


class _Hurry:
    """Stop signals while a job is stopped: noted (``now``), and said once, instead of raising
    KeyboardInterrupt in the middle of it."""

    def __init__(self):
        self.now = False
        self.previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; and only it gets signals
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._hurry)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def _hurry(self, signum, frame) -> None:
        if not self.now:
            print("stopping now: killing what is left of the job", file=sys.stderr, flush=True)
        self.now = True
