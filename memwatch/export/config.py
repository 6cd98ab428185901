"""Which exporters the sidecar runs: from ``memwatch serve`` options, else from the environment.

Every option has an environment twin (``MEMWATCH_PROMETHEUS``, ``MEMWATCH_OTLP``, ``MEMWATCH_CONSOLE``)
so that a sidecar the plugin starts on its own is configured the same way. ``OTEL_METRICS_EXPORTER``
(``otlp``, ``prometheus``, ``console``, comma-separated) is honoured too when none of those is set, as
any OpenTelemetry program does; the OTLP endpoint, headers, resource attributes and export interval
come from the standard ``OTEL_*`` variables, read by the OpenTelemetry SDK itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import UsageError
from .headroom import HeadroomConfig
from .state import DEFAULT_LINGER_SECONDS

DEFAULT_PROMETHEUS_PORT = 9464
"""The port OpenTelemetry's Prometheus exporter uses by default."""

OTLP_FROM_ENV = ""
"""``--otlp`` given without an endpoint: the SDK takes it from ``OTEL_EXPORTER_OTLP_*`` (or localhost:4318)."""

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class ExportConfig:
    """The exporters to run; all off by default."""

    prometheus: tuple[str, int] | None = None
    otlp: str | None = None
    """An OTLP/HTTP endpoint (base URL), :data:`OTLP_FROM_ENV`, or ``None`` for no OTLP."""
    console: bool = False
    linger: float = DEFAULT_LINGER_SECONDS
    headroom: HeadroomConfig = field(default_factory=HeadroomConfig)
    """The headroom gauges' shapes and staleness (``serve --admission-shape``, ``--signal-stale-after``)."""

    @property
    def enabled(self) -> bool:
        return self.prometheus is not None or self.otlp is not None or self.console

    def describe(self) -> list[str]:
        """One phrase per exporter, for the sidecar's start line."""
        parts = []
        if self.prometheus is not None:
            parts.append(f"Prometheus on http://{_join(*self.prometheus)}/metrics")
        if self.otlp is not None:
            parts.append(f"OTLP/HTTP to {self.otlp or 'the OTEL_EXPORTER_OTLP_* endpoint'}")
        if self.console:
            parts.append("console")
        return parts


def parse_listen(value: str, what: str = "--prometheus") -> tuple[str, int]:
    """``[HOST:]PORT`` -> (host, port); the host is 127.0.0.1 unless one is given."""
    text = value.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host = "127.0.0.1"
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise UsageError(f"{what} {value!r} is not [HOST:]PORT with a port from 0 to 65535; "
                         f"give e.g. {DEFAULT_PROMETHEUS_PORT} or 0.0.0.0:{DEFAULT_PROMETHEUS_PORT}")
    return host, port


def _join(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _otlp_endpoint(value: str) -> str:
    text = value.strip()
    if text.lower() in _TRUE:
        return OTLP_FROM_ENV
    if text and not text.startswith(("http://", "https://")):
        raise UsageError(f"--otlp endpoint {value!r} is not an http:// or https:// URL; "
                         f"give e.g. http://localhost:4318 (OTLP over HTTP/protobuf)")
    return text.rstrip("/")


def export_config(prometheus: str | None = None, otlp: str | None = None, console: bool = False,
                  linger: float | None = None, env: Mapping[str, str] | None = None) -> ExportConfig:
    """The exporters from command-line values, falling back to the environment for each one not given."""
    env = os.environ if env is None else env
    if prometheus is None:
        prometheus = env.get("MEMWATCH_PROMETHEUS") or None
    if otlp is None:
        otlp = env.get("MEMWATCH_OTLP") or None
    console = console or env.get("MEMWATCH_CONSOLE", "").strip().lower() in _TRUE
    if prometheus is None and otlp is None and not console:
        prometheus, otlp, console = _from_otel_env(env)
    if linger is None:
        try:
            linger = float(env.get("MEMWATCH_EXPORT_LINGER", DEFAULT_LINGER_SECONDS))
        except ValueError:
            raise UsageError("MEMWATCH_EXPORT_LINGER is not a number of seconds; unset it or give e.g. 60") from None
    return ExportConfig(
        prometheus=None if prometheus is None else parse_listen(prometheus),
        otlp=None if otlp is None else _otlp_endpoint(otlp),
        console=console, linger=linger,
    )


def _from_otel_env(env: Mapping[str, str]) -> tuple[str | None, str | None, bool]:
    chosen = {name.strip().lower() for name in env.get("OTEL_METRICS_EXPORTER", "").split(",") if name.strip()}
    unknown = chosen - {"otlp", "prometheus", "console", "none"}
    if unknown:
        raise UsageError(f"OTEL_METRICS_EXPORTER names {', '.join(sorted(unknown))}; memwatch exports with "
                         f"otlp, prometheus and console")
    prometheus = None
    if "prometheus" in chosen:
        host = env.get("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
        port = env.get("OTEL_EXPORTER_PROMETHEUS_PORT", str(DEFAULT_PROMETHEUS_PORT))
        prometheus = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return prometheus, OTLP_FROM_ENV if "otlp" in chosen else None, "console" in chosen
