"""SIGINT and SIGTERM become a daemon's clean stop (its ``stop`` callable), for every command
that runs one (``wavelet ps``, ``worker``, ``run``)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

log = logging.getLogger(__name__)


def on_signals(stop: Callable[[], None]) -> None:
    def handler(signum, frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
