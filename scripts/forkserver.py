"""Daemons forked from a process that imported torch once, instead of a fresh Python each.

A daemon started as ``python -m wavelet.scripts.cli`` spends 2-3 s of CPU importing torch and,
in a shard, about 2 s more on torch._dynamo (torch.optim's step wrappers import it): on a small
job that is most of the CPU its processes use, and it delays every start and every restart
(``benchmarks/bench_spawn.py``). The launcher therefore starts one fork server per job: a
process that imports torch and Wavelet's daemons, then forks each daemon from itself, so a
daemon starts with its imports done. A forked daemon is an ordinary process with its own pid,
session, log file, environment and working directory; it runs the same ``cli.main`` and exits
through the interpreter's normal shutdown, as it would have after exec.

What fork needs, and what this module ensures: the server never initialises CUDA (a forked child
could not use it) and runs no torch operation, so no thread pool exists to be copied half-way;
it reaps its children and tells the launcher each one's exit status. If the launcher dies, the
server gets SIGTERM (``PR_SET_PDEATHSIG``) and so do its children, as with exec; if the server
cannot start, the launcher says why and execs its daemons as before (``LaunchConfig.spawn``).

Messages between the launcher and its server are JSON lines over a private socket pair (not the
job's wire protocol: nothing else can reach it).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import io
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

log = logging.getLogger(__name__)

# What a daemon imports anyway, imported once in the server. torch._dynamo comes in with the
# first optimizer a shard builds; torch.distributed with the all-reduce ranks.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "wavelet.scripts.cli",
    "wavelet.ps.service",
    "wavelet.worker.daemon",
    "wavelet.worker.allreduce",
)
ENTRY_MODULE = "wavelet.scripts.cli"  # whose main() runs a daemon's command line
READY_TIMEOUT_S = 120.0  # the server's imports: about 5 s of CPU; slow machines, busy cores
REAP_EVERY_S = 0.1  # how often the server looks for exited children between requests
TEMP_LOG_PREFIX = "wavelet-forkserver-"  # the server's output, where no log path is given


def die_with_parent() -> None:
    """In a child: get SIGTERM when the parent dies, so no daemon outlives its launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


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
                [sys.executable, "-m", "wavelet.scripts.forkserver", str(theirs.fileno())]
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

        The caller must be the process's entry point (``cli.main`` called by ``sys.exit``, no
        handler above it): the server, and each daemon forked from it, leave by raising
        SystemExit through the caller's frames to the interpreter's normal exit."""
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
        if pid == 0:  # the server, until the launcher hangs up; then out, as Python exits
            try:
                ours.close()
                _become_server(theirs.fileno(), log_path, _server_env(env), launcher)
                serve(theirs.fileno(), str(log_path))
            except Exception:  # never into a caller's handler: out, as Python itself would
                traceback.print_exc()
                sys.exit(1)
            sys.exit(0)
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
        _remove_if_empty_temporary(self.log_path)  # the server's own cleanup, if it was killed

    def _send(self, message: dict) -> None:
        try:
            self.sock.sendall(_encode(message))
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
        messages, self._buffer = _decode(self._buffer + data)
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


def _encode(message: dict) -> bytes:
    """One message on the launcher-server socket: a line of JSON (both directions)."""
    return json.dumps(message).encode() + b"\n"


def _decode(buffer: bytes) -> tuple[list[dict], bytes]:
    """The whole messages in ``buffer``, and what is left of a message still arriving."""
    *lines, rest = buffer.split(b"\n")
    return [json.loads(line) for line in lines], rest


def _remove_if_empty_temporary(log_path: Path) -> None:
    """A server's temporary log (no path given) is worth keeping only if something was said."""
    if log_path.name.startswith(TEMP_LOG_PREFIX):
        with contextlib.suppress(OSError):
            if log_path.stat().st_size == 0:
                log_path.unlink()


# The server's end ---------------------------------------------------------------------------


def serve(fd: int, log_path: str = "") -> None:
    """Import what daemons need, then fork one per request until the launcher hangs up (or
    dies: SIGTERM). A temporary log left empty is removed on the way out."""
    server_pid = os.getpid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        _serve(socket.socket(fileno=fd))
    finally:
        # a forked daemon leaves through here too, when its command ends: not its business
        if os.getpid() == server_pid and log_path:
            _remove_if_empty_temporary(Path(log_path))


def _become_server(fd: int, log_path: Path, env: dict[str, str], launcher: int) -> None:
    """In a server forked from the launcher: what ``start``'s exec would have given it (own
    session, output to its log, nothing else of the launcher's open, its command line)."""
    os.setsid()
    die_with_parent()
    if os.getppid() != launcher:  # it died before the line above: nobody to serve
        sys.exit(0)
    _redirect_stdio(log_path, append=True)
    os.closerange(3, fd)  # descriptors the launcher inherited (a caller's pipes), not Python's
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    # the title before the environment changes: setproctitle finds its memory beside it
    _retitle([sys.executable, "-m", "wavelet.scripts.forkserver", str(fd), str(log_path)])
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its own session: the launcher stops it


def _serve(sock: socket.socket) -> None:
    try:
        _preload()
    except Exception as e:  # any import failing: the launcher execs its daemons instead
        _send(sock, {"error": f"the fork server could not import what daemons need: {e!r}"})
        return
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use CUDA
        _send(sock, {"error": "CUDA was initialised while importing; daemons cannot be forked"})
        return
    _send(sock, {"ready": True})
    buffer = b""
    while True:
        ready, _, _ = select.select([sock], [], [], REAP_EVERY_S)
        _reap(sock)
        if not ready:
            continue
        data = sock.recv(65536)
        if not data:  # the launcher is done (or gone): so is this server
            return
        requests, buffer = _decode(buffer + data)
        for request in requests:
            with warnings.catch_warnings():
                # Python 3.12+ warns on fork with threads: the other thread here is numpy's
                # OpenBLAS pool, idle, which re-forms itself after fork (pthread_atfork).
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # this process is now the daemon; the server's loop ends here for it
                sock.close()
                _become_daemon(request)
            _send(sock, {"pid": pid})


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    try:
        from setproctitle import getproctitle
    except ImportError:  # daemons show the server's command line (``_retitle``)
        return
    getproctitle()  # finds the title's memory now: a child's changed environment would hide it


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.sendall(_encode(message))
    except OSError:
        pass  # the launcher is gone; the loop ends at the next read


def _become_daemon(request: dict) -> None:
    """In the forked child: the process ``python -m wavelet.scripts.cli ARGS`` would have been
    (own session, output to the log, stdin from /dev/null, the given environment and working
    directory), then run the command and exit as Python exits."""
    os.setsid()
    die_with_parent()
    _redirect_stdio(request["log"], request.get("err"), request["append"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # the command line's module, by name: it imports this one, not the other way round
    cli = importlib.import_module(ENTRY_MODULE)
    sys.argv = [cli.__file__, *request["args"]]
    _retitle([sys.executable, "-m", ENTRY_MODULE, *request["args"]])
    sys.exit(cli.main(request["args"], entry_point=True))  # nothing above it but this server


def _redirect_stdio(log: str | Path, err: str | Path | None = None, append: bool = True) -> None:
    """Standard input from /dev/null, output (and errors, unless ``err``) to ``log``: what exec
    with a log file gives a process. Unbuffered, as exec'd daemons run (PYTHONUNBUFFERED): a
    killed process's log is whole."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    out = os.open(log, flags, 0o644)
    # one open file for both, unless apart: their writes must not overlap
    errors = os.open(err, flags, 0o644) if err else out
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, standard in ((null, 0), (out, 1), (errors, 2)):
        os.dup2(fd, standard)
    for fd in {null, out, errors}:
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )


def _retitle(command: list[str]) -> None:
    """Show the daemon's own command in ps, top and /proc/PID/cmdline (space-separated), not
    the fork server's: how users and ``wavelet clean`` tell a job's daemons apart."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # a Python without it (the GPU machine's, unless from ./wheels)
        return
    setproctitle(" ".join(command))


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
