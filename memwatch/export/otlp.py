"""OTLP over HTTP/protobuf: metric and log exporters that fail in one line and keep retrying.

The OpenTelemetry SDK's exporters already run off the ingest path (a periodic reader thread for
metrics, a batch processor thread for logs). What they do not do is stay quiet: an unreachable
collector logs a warning per attempt. These wrappers log one line when the endpoint stops answering
and one when it answers again; the next period simply tries again. Metrics are cumulative, so the
first export that gets through carries every count; flag log records queued while it was down are
dropped once the batch processor's queue is full (2048 records).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

log = logging.getLogger("memwatch.export")

_SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.exporter.otlp.proto.common",
                "opentelemetry.sdk.metrics._internal.export", "opentelemetry.sdk._logs._internal.export",
                "opentelemetry.sdk._shared_internal")


def quiet_sdk_loggers() -> None:
    """Leave export failures to the one-line reports below (the SDK would log every attempt)."""
    for name in _SDK_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def signal_endpoint(base: str, signal: str) -> str | None:
    """``http://host:4318`` -> ``http://host:4318/v1/metrics``; ``None`` leaves it to ``OTEL_*``."""
    if not base:
        return None
    for suffix in ("/v1/metrics", "/v1/logs"):
        base = base.removesuffix(suffix)
    return f"{base}/v1/{signal}"


class _Reachability:
    """One line when an endpoint starts failing, one when it works again."""

    def __init__(self, what: str, endpoint: str) -> None:
        self._what = what
        self._endpoint = endpoint
        self._failing = False
        self._lock = threading.Lock()
        self.failures = 0

    def report(self, ok: bool, why: str = "") -> None:
        with self._lock:
            if ok and self._failing:
                log.warning("otlp: %s reach %s again", self._what, self._endpoint)
            elif not ok:
                self.failures += 1
                if not self._failing:
                    log.warning("otlp: cannot export %s to %s%s; ingest goes on, retrying every export period",
                                self._what, self._endpoint, f" ({why})" if why else "")
            self._failing = not ok


class ResilientMetricExporter(MetricExporter):
    """An OTLP metric exporter whose failures are one line each way and never an exception."""

    def __init__(self, endpoint: str | None) -> None:
        self._inner = OTLPMetricExporter(endpoint=endpoint)
        super().__init__(preferred_temporality=self._inner._preferred_temporality,
                         preferred_aggregation=self._inner._preferred_aggregation)
        self.endpoint = self._inner._endpoint
        self.reachability = _Reachability("metrics", self.endpoint)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis)
        except Exception as exc:  # an exporter bug must not end the reader thread
            self.reachability.report(False, str(exc))
            return MetricExportResult.FAILURE
        self.reachability.report(result is MetricExportResult.SUCCESS)
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis)


class ResilientLogExporter(LogRecordExporter):
    """An OTLP log-record exporter with the same one-line failure reports."""

    def __init__(self, endpoint: str | None) -> None:
        self._inner = OTLPLogExporter(endpoint=endpoint)
        self.endpoint = self._inner._endpoint
        self.reachability = _Reachability("flag log records", self.endpoint)

    def export(self, batch: Sequence[Any]) -> LogRecordExportResult:
        try:
            result = self._inner.export(batch)
        except Exception as exc:
            self.reachability.report(False, str(exc))
            return LogRecordExportResult.FAILURE
        self.reachability.report(result is LogRecordExportResult.SUCCESS)
        return result

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._inner.shutdown()
