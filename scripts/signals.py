"""SIGINT and SIGTERM become a daemon's clean stop (its ``stop`` callable), for every command
that runs one (``wavelet ps``, ``worker``, ``run``); SIGINT interrupts the launcher."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

log = logging.getLogger(__name__)

INTERRUPTED = 130  # the exit status of a launch, compare or tune stopped by Ctrl-C (128 + SIGINT)


def on_signals(stop: Callable[[], None]) -> None:
    def handler(signum, frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def interrupt_on_sigint() -> None:
    """SIGINT raises KeyboardInterrupt (the launcher then tears its job down), even in a process
    started with SIGINT ignored, as a shell script's background jobs are: Python installs its
    handler only where SIGINT was not ignored at start, and the daemons already stop on it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
