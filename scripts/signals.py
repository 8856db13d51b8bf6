"""SIGINT and SIGTERM become a daemon's clean stop (its ``stop`` callable), for every command
that runs one (``wavelet ps``, ``worker``, ``run``); both interrupt the launcher (``launch``,
``compare``, ``tune``), which then stops its job."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

INTERRUPTED = 130  # the exit status of a launch, compare or tune stopped by Ctrl-C (128 + SIGINT)


def on_signals(stop: Callable[[], None]) -> None:
    def handler(signum, frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def interrupt_on_stop_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt (the launcher then tears its job down and removes
    what it made, such as a --slow-device cgroup), even in a process started with SIGINT ignored,
    as a shell script's background jobs are: Python installs its handler only where SIGINT was not
    ignored at start, and the daemons already stop on both."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def stop_with_parent(stop: Callable[[], None], every_s: float = 0.5, grace_s: float = 30.0) -> None:
    """Call ``stop`` once this process's parent is gone, and end the process ``grace_s`` later
    whatever the stop did. torchrun's agent starts its workers in sessions of their own, so a
    killed agent (or its killed process group) leaves them running, re-parented to init; this
    ties their life to the agent's instead."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        log.warning("the parent process (%d) is gone: stopping", parent)
        stop()
        time.sleep(grace_s)
        log.error("still running %.0f s after the parent went: exiting", grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
