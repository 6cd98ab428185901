"""Flags as OpenTelemetry log records: one record per flag, so a backend can draw them as annotations.

The body is the flag's sentence; the attributes are the run's (run id, rank, engine, model, host,
pid), the flag's kind, severity and step, and its numbers as ``memwatch.flag.data`` (JSON). The
record's time is the engine's time of the step that raised it. Emitting only queues the record; a
batch processor exports it from its own thread.
"""

from __future__ import annotations

import json
from typing import Any

from opentelemetry._logs import Logger, SeverityNumber

from ..flags import CRITICAL, INFO, WARNING, Flag
from .state import ExportState

_SEVERITY = {INFO: SeverityNumber.INFO, WARNING: SeverityNumber.WARN, CRITICAL: SeverityNumber.ERROR}


def flag_attributes(flag: Flag, run: dict[str, Any]) -> dict[str, Any]:
    """The attributes of a flag's log record."""
    return {**run, "run_id": flag.run_id, "rank": flag.rank, "kind": flag.kind, "severity": flag.severity,
            "step": flag.step, "memwatch.flag.data": json.dumps(flag.data, sort_keys=True)}


class FlagLogger:
    """Flag listener of an :class:`ExportState` that emits each flag as a log record."""

    def __init__(self, logger: Logger, state: ExportState) -> None:
        self._logger = logger
        self._state = state

    def __call__(self, flag: Flag) -> None:
        self._logger.emit(
            timestamp=flag.ts_ns, severity_number=_SEVERITY.get(flag.severity, SeverityNumber.WARN),
            severity_text=flag.severity.upper(), body=flag.message, event_name=f"memwatch.flag.{flag.kind}",
            attributes=flag_attributes(flag, self._state.attributes_of(flag.run_id, flag.rank)),
        )
