"""How Wavelet's own processes end: what Python does on its way out that matters (other threads
joined, ``atexit`` callbacks such as logging's flush and multiprocessing's reaping of its
children, standard output and errors flushed), then ``os._exit``, without the interpreter's
teardown of every module.

That teardown frees torch's and torch._dynamo's thousands of objects one by one: a Python that
imported them took 0.93 s from its last line to its exit, 0.05 s this way, and 0.86 s less CPU
in all (``benchmarks/bench_exit.py``, medians of 7 rounds on the development machine). Every
daemon, launcher and fork server pays it once, at the end of a job, and a job's last shard stops
only after its workers have paid it. Nothing Wavelet writes depends on it: files are closed (or
line-buffered) where they are written, shared memory is unlinked when a segment closes or is a
memfd, and sockets close with the process as they would at the interpreter's exit."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn


def exit_now(code: int | str | None) -> NoReturn:
    """End this process with ``code`` (``sys.exit``'s meaning: None is 0, a string is printed
    and means 1) as Python would, less the teardown of its modules."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    main = threading.main_thread()
    for thread in threading.enumerate():  # what the interpreter waits for before atexit
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or replaced by None
            pass
    os._exit(0 if code is None else int(code))


def run_and_exit(body: Callable[[], int | str | None]) -> NoReturn:
    """Run ``body`` as the whole of this process's work, then ``exit_now`` with its status: what
    it returned, a SystemExit's code, or 1 after the traceback of an exception that escaped it,
    as Python itself would end (KeyboardInterrupt goes on up, to Python's own handling)."""
    try:
        code = body()
    except SystemExit as e:
        code = e.code
    except Exception:
        traceback.print_exc()
        code = 1
    exit_now(code)
