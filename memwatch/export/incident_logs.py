"""Each shipped incident bundle as one OpenTelemetry log record, ``memwatch.incident``, on the flag records' path.

The body says where the bundle is and what happened; the attributes carry the same as fields a backend can
query: ``memwatch.incident.uri``, ``memwatch.incident.verdict`` (``memwatch check``'s, from the manifest),
``memwatch.incident.trigger`` (what made the sidecar build it), ``memwatch.incident.bytes`` and ``run_id``.
Emitting only queues the record; the logger provider's batch processor exports it (the sidecar's stop flushes it
after the last uploads).
"""

from __future__ import annotations

import time

from opentelemetry._logs import Logger, SeverityNumber

from ..incident.ship import Shipped

EVENT_NAME = "memwatch.incident"


def incident_attributes(shipped: Shipped) -> dict[str, str | int]:
    return {"run_id": shipped.run_id, "memwatch.incident.uri": shipped.uri,
            "memwatch.incident.verdict": shipped.verdict, "memwatch.incident.trigger": shipped.trigger,
            "memwatch.incident.bytes": shipped.size_bytes}


class IncidentLogger:
    """An announcer of the shipper (:class:`memwatch.incident.ship.Shipper`) that emits the log record."""

    def __init__(self, logger: Logger) -> None:
        self._logger = logger

    def __call__(self, shipped: Shipped) -> None:
        self._logger.emit(timestamp=time.time_ns(), severity_number=SeverityNumber.WARN, severity_text="WARNING",
                          body=f"incident bundle {shipped.uri} ({shipped.verdict}, {shipped.trigger})",
                          event_name=EVENT_NAME,
                          attributes=incident_attributes(shipped))
