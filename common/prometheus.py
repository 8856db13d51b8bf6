"""Serving a daemon's metrics in the Prometheus text format at http://HOST:PORT/metrics.

Off unless asked for (``--metrics-port``). Each daemon has its own registry, so only its metrics
are served; port 0 picks a free port, which the daemon logs and writes next to its other files so
that ``wavelet launch`` can list every daemon's address.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

from wavelet.common.config import ConfigError

log = logging.getLogger(__name__)


class MetricsEndpoint:
    """An HTTP server in a daemon thread serving ``registry``; ``stop()`` closes it."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, name: str):
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {e.strerror}; pick another "
                "--metrics-port (0 picks a free one)"
            ) from None
        self.url = f"http://{host}:{self._server.server_port}/metrics"
        log.info("%s metrics at %s", name, self.url)

    def write_address(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.url + "\n")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
