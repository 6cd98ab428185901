"""The sidecar's exporters put together: one state, one meter provider, one logger provider.

:class:`Exporters` owns the :class:`ExportState` the collector feeds, the OpenTelemetry providers
with a reader per pushing exporter (OTLP, console), the Prometheus endpoint, and the flag log
records. ``close()`` gives metrics and flag records one last export each, bounded by
:data:`CLOSE_SECONDS`, so a sidecar's stop never waits long on an unreachable collector.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version

from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, ConsoleLogRecordExporter, LogRecordExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource

from .config import OTLP_FROM_ENV, ExportConfig
from .flag_logs import FlagLogger
from .incident_logs import IncidentLogger
from .instruments import register_instruments
from .otlp import ResilientLogExporter, ResilientMetricExporter, quiet_sdk_loggers, signal_endpoint
from .prometheus import PrometheusEndpoint
from .state import ExportState

log = logging.getLogger("memwatch.export")

SCOPE = "memwatch"
CLOSE_SECONDS = 5.0
"""The deadline for a last export when the sidecar stops."""


def _version() -> str:
    try:
        return version("memwatch")
    except PackageNotFoundError:
        return "unknown"


def sidecar_resource() -> Resource:
    """The resource of ``OTEL_RESOURCE_ATTRIBUTES``/``OTEL_SERVICE_NAME``; ``service.name`` memwatch by default."""
    detected = Resource.create()
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        detected = detected.merge(Resource({SERVICE_NAME: "memwatch", "service.version": _version()}))
    return detected


class Exporters:
    """Every exporter the sidecar runs, fed by one :class:`ExportState` (the collector observer)."""

    def __init__(self, config: ExportConfig) -> None:
        self.config = config
        self.state = ExportState(linger=config.linger, headroom=config.headroom)
        self.prometheus: PrometheusEndpoint | None = None
        self.otlp_metrics: ResilientMetricExporter | None = None
        self.otlp_logs: ResilientLogExporter | None = None
        self.meter_provider: MeterProvider | None = None
        self.logger_provider: LoggerProvider | None = None

    def start(self) -> None:
        """Open the endpoint and start the readers; raises :class:`UnavailableError` on a taken port."""
        config = self.config
        readers: list[MetricReader] = []
        log_exporters: list[LogRecordExporter] = []
        if config.otlp is not None:
            quiet_sdk_loggers()
        resource = sidecar_resource()
        if config.prometheus is not None:
            self.prometheus = PrometheusEndpoint(*config.prometheus, self.state, dict(resource.attributes))
            self.prometheus.start()
        if config.otlp is not None:
            self.otlp_metrics = ResilientMetricExporter(signal_endpoint(config.otlp, "metrics"))
            self.otlp_logs = ResilientLogExporter(signal_endpoint(config.otlp, "logs"))
            readers.append(PeriodicExportingMetricReader(self.otlp_metrics))
            log_exporters.append(self.otlp_logs)
        if config.console:
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stdout)))
            log_exporters.append(ConsoleLogRecordExporter(out=sys.stdout))
        if readers:  # the Prometheus endpoint renders the state itself; the SDK serves the pushing exporters
            self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
            register_instruments(self.meter_provider.get_meter(SCOPE, _version()), self.state)
        if log_exporters:
            self.logger_provider = LoggerProvider(resource=resource)
            for exporter in log_exporters:
                self.logger_provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
            self.state.add_flag_listener(FlagLogger(self.logger_provider.get_logger(SCOPE, _version()), self.state))

    def incident_logger(self) -> IncidentLogger | None:
        """The announcer of shipped incident bundles on the log records' path (``None`` without OTLP or console)."""
        if self.logger_provider is None:
            return None
        return IncidentLogger(self.logger_provider.get_logger(SCOPE, _version()))

    def describe(self) -> list[str]:
        """Where each exporter sends (the Prometheus port as bound, for port 0)."""
        where = self.config.describe()
        if self.prometheus is not None:
            where[0] = f"Prometheus on http://{self.prometheus.host}:{self.prometheus.port}/metrics"
        if self.otlp_metrics is not None and self.config.otlp == OTLP_FROM_ENV:  # say which one the SDK took
            where[1 if self.prometheus is not None else 0] = f"OTLP/HTTP to {self.otlp_metrics.endpoint}"
        return where

    def watch_losses(self, source: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        """Where to read (run id, rank, records lost) of the rings being drained."""
        self.state.set_lost_records(source)

    def watch_refused(self, source: Callable[[], dict[str, int]]) -> None:
        """Where to read the rings refused now, by reason (``memwatch.rings.refused``)."""
        self.state.set_refused_rings(source)

    def watch_bundles(self, source: Callable[[], dict[str, int]]) -> None:
        """Where to read the incident bundles' counts (``memwatch.bundles.*``)."""
        self.state.set_bundle_counts(source)

    def close(self) -> None:
        """A last export of everything, bounded by :data:`CLOSE_SECONDS`; then the endpoint goes."""
        millis = CLOSE_SECONDS * 1000
        if self.logger_provider is not None:
            self.logger_provider.force_flush(int(millis))
            self.logger_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown(timeout_millis=millis)
        if self.prometheus is not None:
            self.prometheus.close()
