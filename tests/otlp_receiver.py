"""A local OTLP/HTTP receiver for tests: it decodes the real protobuf payloads the sidecar posts."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def any_value(value: AnyValue) -> Any:
    """A protobuf ``AnyValue`` as a Python value."""
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


def attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in key_values}


class OtlpReceiver:
    """Accepts ``POST /v1/metrics`` and ``/v1/logs`` on 127.0.0.1 and keeps every decoded request."""

    def __init__(self, port: int = 0) -> None:
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.logs: list[ExportLogsServiceRequest] = []
        self.content_types: set[str] = set()
        self.headers: dict[str, str] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.content_types.add(self.headers["Content-Type"])
                receiver.headers.update({k.lower(): v for k, v in self.headers.items()})
                if self.path == "/v1/metrics":
                    receiver.metrics.append(ExportMetricsServiceRequest.FromString(body))
                elif self.path == "/v1/logs":
                    receiver.logs.append(ExportLogsServiceRequest.FromString(body))
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def latest_points(self) -> dict[str, list[tuple[dict[str, Any], Any, str]]]:
        """Each metric name -> (attributes, value, unit) of its data points in the latest request that has it."""
        latest: dict[str, list[tuple[dict[str, Any], Any, str]]] = {}
        for request in self.metrics:
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        data = getattr(metric, metric.WhichOneof("data"))
                        latest[metric.name] = [
                            (attributes(p.attributes), getattr(p, p.WhichOneof("value")), metric.unit)
                            for p in data.data_points
                        ]
        return latest

    def resources(self) -> list[dict[str, Any]]:
        return [attributes(rm.resource.attributes) for request in self.metrics for rm in request.resource_metrics]

    def log_records(self) -> list[Any]:
        return [record for request in self.logs for rl in request.resource_logs for sl in rl.scope_logs
                for record in sl.log_records]
