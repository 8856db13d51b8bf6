"""Daemons forked from a process that imported torch once, instead of a fresh Python each.

A daemon started as ``python -m wavelet.scripts.cli`` spends 2-3 s of CPU importing torch and,
in a shard, about 2 s more on torch._dynamo (torch.optim's step wrappers import it): on a small
job that is most of the CPU its processes use, and it delays every start and every restart
(``benchmarks/bench_spawn.py``). The launcher therefore starts one fork server per job: a
process that imports torch and Wavelet's daemons, then forks each daemon from itself, so a
daemon starts with its imports done. A forked daemon is an ordinary process with its own pid,
session, log file, environment and working directory; it runs the same ``cli.main`` and exits
as it would have after exec (``common/process_exit.py``).

What fork needs, and what this module ensures: the server never initialises CUDA (a forked child
could not use it) and runs no torch operation, so no thread pool exists to be copied half-way;
it reaps its children and tells the launcher each one's exit status. If the launcher dies, the
server gets SIGTERM (``PR_SET_PDEATHSIG``) and so do its children, as with exec; if the server
cannot start, the launcher says why and execs its daemons as before (``LaunchConfig.spawn``).

Messages between the launcher and its server are JSON lines over a private socket pair (not the
job's wire protocol: nothing else can reach it).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from wavelet.common.process_exit import run_and_exit
from wavelet.scripts.forkserver_serve import (
    TEMP_LOG_PREFIX,
    become_server,
    decode,
    die_with_parent,
    encode,
    remove_if_empty_temporary,
    serve,
)

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # the server's imports: about 5 s of CPU; slow machines, busy cores


class ForkServerError(RuntimeError):
    pass


class ForkServer:
    """The launcher's end: start the server, ask it for daemons, learn how they exit."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, log_path: Path):
        self.proc = proc
        self.sock = sock
        self.log_path = log_path
        self._ready = False
        self._buffer = b""
        self._exits: dict[int, int] = {}
        self._replies: list[dict] = []
        self._closed = False

    @classmethod
    def start(
        cls, log_path: Path | None = None, env: dict[str, str] | None = None, wait: bool = True
    ) -> ForkServer:
        """Start a server; with ``wait``, until its imports are done (ForkServerError if they
        fail), else the first ``spawn`` waits, and the imports run beside the caller's work.
        Without ``log_path`` its output goes to a temporary file, removed when it ends well."""
        log_path = log_path or _temporary_log()
        ours, theirs = socket.socketpair()
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "wavelet.scripts.forkserver_serve", str(theirs.fileno())]
                + [str(log_path)],
                pass_fds=[theirs.fileno()],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C reaches the launcher alone
                preexec_fn=die_with_parent,
                env=_server_env(env),
            )
        theirs.close()
        server = cls(proc, ours, log_path)
        if wait:
            server.wait_ready()
        return server

    @classmethod
    def fork_here(
        cls, log_path: Path | None = None, env: dict[str, str] | None = None
    ) -> ForkServer:
        """A server forked from this process, which has done nothing yet but import (the CLI,
        at the top of a command that starts jobs): the server keeps the torch this process
        imported and imports the rest beside the caller's work, 2-3 s of CPU less than
        ``start`` and ready that much sooner. Where the CUDA driver is loaded here already, a
        forked server's children could not use it: ``start`` instead.

        The caller must be the process's entry point (``cli.main``, before it runs anything):
        the server ends here (``run_and_exit``), and each daemon forked from it in its own
        ``cli.main``, never returning to the caller's frames."""
        if _cuda_driver_loaded():
            return cls.start(log_path, env, wait=False)
        log_path = log_path or _temporary_log()
        ours, theirs = socket.socketpair()
        launcher = os.getpid()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # threads: see _serve's fork
                pid = os.fork()
        except OSError:  # no fork now (process limits): a server of its own, as from Python
            ours.close()
            theirs.close()
            return cls.start(log_path, env, wait=False)
        if pid == 0:  # the server, until the launcher hangs up (or SIGTERM); then out
            ours.close()

            def be_the_server() -> None:
                become_server(theirs.fileno(), log_path, _server_env(env), launcher)
                serve(theirs.fileno(), str(log_path))

            run_and_exit(be_the_server)  # never into a caller's handler
        theirs.close()
        return cls(_ChildProcess(pid), ours, log_path)

    def wait_ready(self) -> None:
        """Return once the server's imports are done; ForkServerError (server closed) if not."""
        if self._ready:
            return
        try:
            reply = self._reply(READY_TIMEOUT_S)
            if "ready" not in reply:
                raise ForkServerError(reply.get("error", f"unexpected reply {reply}"))
        except ForkServerError as e:
            self.close()
            raise ForkServerError(f"{e} (its log: {self.log_path})") from None
        self._ready = True

    def spawn(
        self,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        append: bool,
        err_path: Path | None = None,
        cwd: str | Path | None = None,
    ) -> ForkedChild:
        """A daemon running ``wavelet <args>`` with exactly ``env``, its output in ``log_path``
        (its standard error too, unless ``err_path``), in ``cwd`` (default: the caller's)."""
        request = {
            "args": args,
            "env": env,
            "log": str(log_path),
            "err": str(err_path) if err_path else None,
            "append": append,
            "cwd": str(cwd or os.getcwd()),
        }
        self.wait_ready()
        self._send(request)
        reply = self._reply(READY_TIMEOUT_S)
        if "pid" not in reply:
            raise ForkServerError(reply.get("error", f"unexpected reply {reply}"))
        return ForkedChild(self, reply["pid"], args)

    def exit_code(self, pid: int, timeout: float = 0.0) -> int | None:
        """The child's exit status (Popen's convention: -N for signal N), None while it runs."""
        deadline = time.monotonic() + timeout
        while pid not in self._exits and not self._closed:
            left = deadline - time.monotonic()
            if not self._read(max(0.0, left)) and left <= 0:
                break
        return self._exits.get(pid)

    def close(self) -> None:
        """Stop the server (its children should be stopped first: they get SIGTERM with it)."""
        if self._closed:
            return
        self._closed = True
        self.sock.close()
        if not self._ready and self.proc.poll() is None:
            self.proc.terminate()  # still importing: no need to wait for imports nobody uses
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        remove_if_empty_temporary(self.log_path)  # the server's own cleanup, if it was killed

    def _send(self, message: dict) -> None:
        try:
            self.sock.sendall(encode(message))
        except OSError as e:
            raise ForkServerError(f"the fork server is gone ({e})") from None

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ForkServerError(f"the fork server did not answer within {timeout:.0f} s")
            self._read(left)
        return self._replies.pop(0)

    def _read(self, timeout: float) -> bool:
        """Take in what the server sent within ``timeout``; False if nothing came."""
        if self._closed:
            return False
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return False
        try:
            data = self.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._lost()
            return True
        messages, self._buffer = decode(self._buffer + data)
        for message in messages:
            if "exited" in message:
                self._exits[message["exited"]] = message["code"]
            else:
                self._replies.append(message)
        return True

    def _lost(self) -> None:
        """The server died: its children got SIGTERM with it; learn their fate by pid."""
        self._closed = True
        self.sock.close()
        self._replies.append({"error": "the fork server exited"})

    @property
    def closed(self) -> bool:
        """Closed by the launcher, or lost: exit statuses it has not sent will not come."""
        return self._closed


class ForkedChild:
    """A daemon the fork server started, with the part of ``subprocess.Popen`` the supervisor
    uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``)."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self.server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
            if self.returncode is None and self.server.closed:
                # no server left to report it: gone means ended by the server's SIGTERM
                if not _alive(self.pid):
                    self.returncode = -signal.SIGTERM
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            if self.server.closed:
                time.sleep(min(left, 0.1))
            else:
                self.server.exit_code(self.pid, min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that may have been reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ChildProcess:
    """A server forked from this process: the part of ``subprocess.Popen`` ``close`` uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["fork server"], timeout or 0)
            time.sleep(0.01)
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _temporary_log() -> Path:
    fd, name = tempfile.mkstemp(prefix=TEMP_LOG_PREFIX, suffix=".log")
    os.close(fd)
    return Path(name)


def _server_env(env: dict[str, str] | None) -> dict[str, str]:
    # torch.cuda.is_available() by NVML, not the CUDA driver, should anything ask in the
    # server: a driver initialised before fork is unusable in the children
    return {**os.environ, **(env or {}), "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def _cuda_driver_loaded() -> bool:
    """Whether this process loaded the CUDA driver (any CUDA call, ``is_available`` too)."""
    try:
        return "libcuda.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return True  # cannot tell: the safe answer


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
