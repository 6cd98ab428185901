"""``/healthz`` and ``/readyz`` for the sidecar, for a container orchestrator's probes.

A listener of its own (``memwatch serve --health [HOST:]PORT``), so that probes work whether or not
metrics are exported, and a slow or hostile client of ``/metrics`` cannot fail them:

- ``/healthz`` (liveness): 200 while the sidecar's loop keeps turning and its store writer runs;
  503 when the loop has not come round for :data:`STALE_AFTER_S` (stuck) or the writer died, so the
  orchestrator restarts it. A restarted sidecar resumes every ring at its committed cursor.
- ``/readyz`` (readiness): 200 once the database is open and the rings are being drained; 503
  before that, while the database is locked or full (the rings are holding the records), and while
  it stops.

Requests are answered one at a time, each bounded by :data:`REQUEST_TIMEOUT_S`; the body is one line.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer

from .errors import UnavailableError

log = logging.getLogger("memwatch.health")

STALE_AFTER_S = 30.0
REQUEST_TIMEOUT_S = 2.0

Check = Callable[[], tuple[bool, bool, str]]
"""Returns (alive, ready, why-not) for the two endpoints."""


class HealthEndpoint:
    """A tiny HTTP server answering ``GET /healthz`` and ``GET /readyz`` from ``check``."""

    def __init__(self, host: str, port: int, check: Check) -> None:
        self.host = host
        self._requested_port = port
        self._check = check
        self._server: HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        check = self._check

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S  # a client that sends nothing holds the listener this long at most

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path not in ("/healthz", "/readyz"):
                    self._reply(404, "memwatch serves /healthz and /readyz here")
                    return
                try:
                    alive, ready, why = check()
                except Exception as exc:  # a probe must get an answer, never a dropped connection
                    alive, ready, why = False, False, f"the health check failed: {type(exc).__name__}"
                good = alive if path == "/healthz" else alive and ready
                self._reply(200 if good else 503, "ok" if good else why)

            def _reply(self, code: int, text: str) -> None:
                body = (text + "\n").encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass  # a probe every few seconds is not news

        server_class = type("HealthServer", (HTTPServer,), {})
        if ":" in self.host:
            server_class.address_family = socket.AF_INET6
        try:
            self._server = server_class((self.host, self._requested_port), Handler)
        except OSError as exc:
            raise UnavailableError(f"cannot listen on {self.host}:{self._requested_port} for --health: "
                                   f"{exc.strerror or exc}; pass another [HOST:]PORT") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="memwatch-health", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server is not None else self._requested_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT_S + 1)
            self._thread = None
