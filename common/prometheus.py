"""Serving a daemon's metrics in the Prometheus text format at http://HOST:PORT/metrics.

Off unless asked for (``--metrics-port``). Each daemon has its own registry, so only its metrics
are served; port 0 picks a free port, which the daemon logs and writes next to its other files so
that ``wavelet launch`` can list every daemon's address.
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from wavelet.common.settings import ConfigError

log = logging.getLogger(__name__)


PATH = "/metrics"


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass  # one line per scrape would drown the daemon's log


def _only_metrics(app):
    """Serve ``app`` at /metrics alone: any other path is a 404, not the metrics."""

    def serve(environ, start_response):
        if environ.get("PATH_INFO") != PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [f"metrics are served at {PATH}\n".encode()]
        return app(environ, start_response)

    return serve


class MetricsEndpoint:
    """An HTTP server in a daemon thread serving ``registry`` at /metrics; ``stop()`` closes
    it."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, name: str):
        try:
            self._server = make_server(
                host,
                port,
                _only_metrics(make_wsgi_app(registry)),
                server_class=_Server6 if ":" in host else _Server,
                handler_class=_QuietHandler,
            )
        except OSError as e:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {e.strerror}; pick another "
                "--metrics-port (0 picks a free one)"
            ) from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()
        self.url = f"http://{host}:{self._server.server_port}{PATH}"
        log.info("%s metrics at %s", name, self.url)

    def write_address(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.url + "\n")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
