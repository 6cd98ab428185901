"""The Prometheus scrape endpoint: the text exposition format rendered straight from the state.

Names and labels are what OpenTelemetry's Prometheus exporter makes of the same instruments (dots
become underscores, unit ``By`` adds ``_bytes``, a monotonic sum adds ``_total``, the resource
becomes ``target_info``). The lines are built directly from the :class:`ExportState` snapshot, with
each rank's label set rendered once: going through the SDK's aggregation and a generic exposition
library costs twenty times as much per series, and a scrape of 64 ranks must stay cheap for the
sidecar. It listens on 127.0.0.1 unless a host is given, in its own named daemon threads, bounded in
number, sockets and time by :mod:`.http_serving`.
"""

from __future__ import annotations

import logging
import re
import socket
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from ..errors import UnavailableError
from ..identity import prometheus_labels
from .http_serving import BoundedServing
from .instruments import FLAGS_METRIC, METRICS
from .state import ExportState

log = logging.getLogger("memwatch.export")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(name: str, unit: str) -> str:
    """``hw.gpu.memory.usage`` in ``By`` -> ``hw_gpu_memory_usage_bytes`` (a counter adds ``_total`` on top)."""
    return _INVALID.sub("_", name) + ("_bytes" if unit == "By" else "")


def _escape(value: Any) -> str:
    return str(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def render_labels(attributes: dict[str, Any]) -> str:
    """``{"run_id": "a", "hw.id": 0}`` -> ``run_id="a",hw_id="0"`` (no braces, so more can follow)."""
    return ",".join(f'{_INVALID.sub("_", key)}="{_escape(value)}"' for key, value in attributes.items())


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def render(state: ExportState, resource: dict[str, Any] | None = None) -> str:
    """Every metric of every live rank in the Prometheus text format."""
    ranks = state.snapshot()
    labels = {id(series): render_labels(prometheus_labels(series.attributes)) for series in ranks}
    hw_labels = {id(series): render_labels(prometheus_labels({**series.attributes, **series.hardware}))
                 for series in ranks}
    out: list[str] = []
    if resource:
        out += ["# HELP target_info Target metadata", "# TYPE target_info gauge",
                f"target_info{{{render_labels(resource)}}} 1"]
    for spec in METRICS:
        name = prometheus_name(spec.name, spec.unit)
        counter = spec.kind == "counter"
        sample = name + "_total" if counter else name
        out += [f"# HELP {sample} {spec.description}", f"# TYPE {sample} {'counter' if counter else 'gauge'}"]
        by_rank = hw_labels if spec.name.startswith("hw.") else labels
        read = spec.read
        for series in ranks:
            value = read(series)
            if value is not None:
                out.append(f"{sample}{{{by_rank[id(series)]}}} {_number(value)}")
    flags = prometheus_name(FLAGS_METRIC, "") + "_total"
    out += [f"# HELP {flags} Flags the live detectors raised, by kind and severity", f"# TYPE {flags} counter"]
    for series in ranks:
        base = labels[id(series)]
        out += [f'{flags}{{{base},kind="{kind}",severity="{severity}"}} {count}'
                for kind, severity, count in state.flag_counts(series)]
    return "\n".join(out) + "\n"


class PrometheusEndpoint:
    """An HTTP server that answers ``GET /metrics`` with :func:`render` of the state."""

    def __init__(self, host: str, port: int, state: ExportState, resource: dict[str, Any] | None = None) -> None:
        self.host = host
        self.state = state
        self.resource = resource
        self._requested_port = port
        self._server: HTTPServer | None = None
        self._serving: BoundedServing | None = None

    def start(self) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404, "memwatch serves /metrics")
                    return
                try:
                    body = render(endpoint.state, endpoint.resource).encode()
                except Exception as exc:  # a scrape must never take the sidecar's log down with a traceback
                    log.error("prometheus: cannot render /metrics: %s", exc)
                    self.send_error(500, "memwatch could not render its metrics; see the sidecar's log")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass  # a scrape every few seconds is not news

        server_class = type("Server", (HTTPServer,), {"request_queue_size": 128})
        if ":" in self.host:
            server_class.address_family = socket.AF_INET6
        try:
            self._server = server_class((self.host, self._requested_port), Handler)
        except OSError as exc:
            raise UnavailableError(f"cannot listen on {self.host}:{self._requested_port} for --prometheus: "
                                   f"{exc.strerror or exc}; pass another [HOST:]PORT") from None
        self._serving = BoundedServing(self._server)  # bounded threads and sockets, idle connections timed out
        self._serving.start()

    @property
    def port(self) -> int:
        """The port it listens on (the one the system chose, for port 0)."""
        return self._server.server_address[1] if self._server is not None else self._requested_port

    def close(self) -> None:
        if self._server is not None:
            if self._serving is not None:
                self._serving.close()
            self._server.server_close()
            self._server = None
