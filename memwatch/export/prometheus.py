"""The Prometheus scrape endpoint: OpenTelemetry's Prometheus reader served over HTTP.

Collection happens on each scrape, in the HTTP server's thread, from a private registry (so nothing
else in the process leaks into ``/metrics``). It listens on 127.0.0.1 unless a host is given.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, start_http_server

from ..errors import UnavailableError

log = logging.getLogger("memwatch.export")


class PrometheusEndpoint:
    """A :class:`PrometheusMetricReader` and the HTTP server that exposes it."""

    def __init__(self, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.reader = PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)
        self.host = host
        self._requested_port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self._server, self._thread = start_http_server(self._requested_port, self.host, self.registry)
        except OSError as exc:
            raise UnavailableError(f"cannot listen on {self.host}:{self._requested_port} for --prometheus: "
                                   f"{exc.strerror or exc}; pass another [HOST:]PORT") from None
        self._thread.name = "memwatch-prometheus"

    @property
    def port(self) -> int:
        """The port it listens on (the one the system chose, for port 0)."""
        return self._server.server_port if self._server is not None else self._requested_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = None
