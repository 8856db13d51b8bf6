"""The fork server's own end (``scripts/forkserver.py`` is the launcher's): it imports what
daemons need once, then forks one daemon per request, each a process of its own with its
session, log and command line, until the launcher hangs up or dies.

Run as ``python -m wavelet.scripts.forkserver_serve FD LOG`` (``ForkServer.start``), or forked
from the launcher itself (``ForkServer.fork_here``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import io
import json
import os
import select
import signal
import socket
import sys
import warnings
from pathlib import Path

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
REAP_EVERY_S = 0.1  # how often the server looks for exited children between requests
TEMP_LOG_PREFIX = "wavelet-forkserver-"  # the server's output, where no log path is given


def die_with_parent() -> None:
    """In a child: get SIGTERM when the parent dies, so no daemon outlives its launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def encode(message: dict) -> bytes:
    """One message on the launcher-server socket: a line of JSON (both directions)."""
    return json.dumps(message).encode() + b"\n"


def decode(buffer: bytes) -> tuple[list[dict], bytes]:
    """The whole messages in ``buffer``, and what is left of a message still arriving."""
    *lines, rest = buffer.split(b"\n")
    return [json.loads(line) for line in lines], rest


def remove_if_empty_temporary(log_path: Path) -> None:
    """A server's temporary log (no path given) is worth keeping only if something was said."""
    if log_path.name.startswith(TEMP_LOG_PREFIX):
        with contextlib.suppress(OSError):
            if log_path.stat().st_size == 0:
                log_path.unlink()


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
            remove_if_empty_temporary(Path(log_path))


def become_server(fd: int, log_path: Path, env: dict[str, str], launcher: int) -> None:
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
    _retitle([sys.executable, "-m", "wavelet.scripts.forkserver_serve", str(fd), str(log_path)])
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
        requests, buffer = decode(buffer + data)
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
        sock.sendall(encode(message))
    except OSError:
        pass  # the launcher is gone; the loop ends at the next read


def _become_daemon(request: dict) -> None:
    """In the forked child: the process ``python -m wavelet.scripts.cli ARGS`` would have been
    (own session, output to the log, stdin from /dev/null, the given environment and working
    directory), then run the command and exit as ``cli.main`` ends a process."""
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
    from wavelet.common.process_exit import run_and_exit

    run_and_exit(lambda: serve(int(sys.argv[1]), sys.argv[2]))
