"""The metrics memwatch exports, as asynchronous OpenTelemetry instruments read from an :class:`ExportState`.

Device level follows the OpenTelemetry hardware conventions (``hw.gpu.memory.usage``, ``.limit``,
``.utilization``); everything engine-specific is ``memwatch.*`` in bytes. The ledger metrics are
named after the terms ``memwatch check`` prints (:data:`PRINTED_TERMS`, from the printed ledger's own
lists), so the two never disagree. Every instrument is observed at collection time (a scrape, a periodic export),
never on the ingest path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from ..report.ledger_text import OUTSIDE_TERMS, SUM_TERMS
from .state import ExportState, RankSeries


class MetricSpec(NamedTuple):
    """One exported metric: its name, unit, instrument kind and what it reads from a rank."""

    name: str
    unit: str
    kind: str
    """``gauge``, ``updown`` (non-monotonic sum) or ``counter`` (monotonic sum)."""
    description: str
    read: Callable[[RankSeries], int | float | None]


def _sample_field(name: str) -> Callable[[RankSeries], int | None]:
    def read(series: RankSeries) -> int | None:
        return None if series.last is None else getattr(series.last, name)
    return read


def _term(name: str) -> Callable[[RankSeries], int | None]:
    def read(series: RankSeries) -> int | None:
        return None if series.terms is None else getattr(series.terms, name)
    return read


def _utilization(series: RankSeries) -> float | None:
    used, limit = _sample_field("driver_used_bytes")(series), series.limit_bytes
    return None if used is None or not limit else used / limit


PRINTED_TERMS: tuple[tuple[str, str], ...] = (
    ("budget_bytes", "budget (total × utilization)"),
    *SUM_TERMS,
    ("headroom_bytes", "headroom (left in the budget)"),
    *((term, f"{label.strip()} ({note})") for term, label, note in OUTSIDE_TERMS),
)
"""Every ledger term a printed ledger shows, in its order: budget, the terms it splits into, headroom, the rest."""


def ledger_metric_name(term: str) -> str:
    """``budget_bytes`` -> ``memwatch.budget`` (Prometheus: ``memwatch_budget_bytes``)."""
    return "memwatch." + term.removesuffix("_bytes")


HARDWARE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("hw.gpu.memory.usage", "By", "updown", "GPU memory used (driver)", _sample_field("driver_used_bytes")),
    MetricSpec("hw.gpu.memory.limit", "By", "updown", "Size of the GPU memory", lambda s: s.limit_bytes),
    MetricSpec("hw.gpu.memory.utilization", "1", "gauge", "Fraction of GPU memory used", _utilization),
)

ALLOCATOR_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("memwatch.allocated", "By", "gauge", "PyTorch allocator: bytes in live tensors",
               _sample_field("allocated_bytes")),
    MetricSpec("memwatch.reserved", "By", "gauge", "PyTorch allocator: bytes reserved from the driver",
               _sample_field("reserved_bytes")),
    MetricSpec("memwatch.peak", "By", "gauge", "PyTorch allocator: peak allocated bytes", _sample_field("peak_bytes")),
)

LEDGER_METRICS: tuple[MetricSpec, ...] = tuple(
    MetricSpec(ledger_metric_name(term), "By", "gauge", f"Ledger: {label}", _term(term))
    for term, label in PRINTED_TERMS
)

KV_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("memwatch.kv.blocks.used", "{block}", "gauge", "KV cache blocks in use",
               lambda s: s.kv_blocks[0]),
    MetricSpec("memwatch.kv.blocks.capacity", "{block}", "gauge", "KV cache blocks allocated",
               lambda s: s.kv_blocks[1]),
)

COUNTER_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("memwatch.samples", "{sample}", "counter", "Samples ingested", lambda s: s.samples),
    MetricSpec("memwatch.preemptions", "{preemption}", "counter", "Requests preempted by the engine",
               lambda s: s.preemptions),
    MetricSpec("memwatch.ooms", "{oom}", "counter", "Out-of-memory errors", lambda s: s.ooms),
    MetricSpec("memwatch.ring.records_lost", "{record}", "counter",
               "Ring records overwritten before the sidecar read them", lambda s: s.lost),
    MetricSpec("memwatch.requests.arrived", "{request}", "counter",
               "Requests the engine's scheduler took in (a router's sent request has reached it)",
               lambda s: s.inputs.arrived),
)

METRICS: tuple[MetricSpec, ...] = HARDWARE_METRICS + ALLOCATOR_METRICS + LEDGER_METRICS + KV_METRICS + COUNTER_METRICS
"""Every per-rank metric; ``memwatch.flags`` (by kind and severity) comes on top."""

FLAGS_METRIC = "memwatch.flags"

RINGS_REFUSED = MetricSpec("memwatch.rings.refused", "{ring}", "gauge",
                           "Rings in the runtime directory the sidecar refuses now, by reason", lambda s: None)
"""A sidecar-wide gauge, not per rank (``read`` is unused): one series per ``reason`` of the fixed set."""


BUNDLE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("memwatch.bundles.built", "{bundle}", "counter", "Incident bundles built", lambda c: c["built"]),
    MetricSpec("memwatch.bundles.shipped", "{bundle}", "counter", "Incident bundles shipped to --bundle-to",
               lambda c: c["shipped"]),
    MetricSpec("memwatch.bundles.failed", "{try}", "counter",
               "Incident bundle builds and uploads that failed (each is tried again)", lambda c: c["failed"]),
    MetricSpec("memwatch.bundles.dropped", "{bundle}", "counter",
               "Incident bundles dropped: the spool's cap, the per-uid rate, a run no longer stored",
               lambda c: c["dropped"]),
    MetricSpec("memwatch.bundles.spooled.size", "By", "gauge", "Bytes of incident bundles waiting to be shipped",
               lambda c: c["spool_bytes"]),
    MetricSpec("memwatch.bundles.spooled", "{bundle}", "gauge", "Incident bundles waiting to be shipped",
               lambda c: c["spool_bundles"]),
)
"""Sidecar-wide series of the incident bundles (``read`` takes :meth:`ExportState.bundle_counts`), present only
while the sidecar builds bundles."""


def _observe_bundles(state: ExportState, spec: MetricSpec) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        counts = state.bundle_counts()
        return [] if counts is None else [Observation(spec.read(counts))]  # sidecar-wide: no attributes
    return callback


def _observe(state: ExportState, spec: MetricSpec) -> Callable[[CallbackOptions], Iterable[Observation]]:
    hardware = spec.name.startswith("hw.")

    def callback(options: CallbackOptions) -> Iterable[Observation]:
        observations = []
        for series in state.snapshot():
            value = spec.read(series)
            if value is not None:
                attributes = {**series.attributes, **series.hardware} if hardware else series.attributes
                observations.append(Observation(value, attributes))
        return observations
    return callback


def _observe_flags(state: ExportState) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(count, {**series.attributes, "kind": kind, "severity": severity})
                for series in state.snapshot() for kind, severity, count in state.flag_counts(series)]
    return callback


def _observe_refused(state: ExportState) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        counts = state.refused_rings() or {}
        return [Observation(n, {"reason": reason}) for reason, n in counts.items()]
    return callback


def register_instruments(meter: Meter, state: ExportState) -> None:
    """Create every instrument on ``meter``, each reading ``state`` when collected."""
    makers = {"gauge": meter.create_observable_gauge, "updown": meter.create_observable_up_down_counter,
              "counter": meter.create_observable_counter}
    for spec in METRICS:
        makers[spec.kind](spec.name, callbacks=[_observe(state, spec)], unit=spec.unit, description=spec.description)
    meter.create_observable_counter(FLAGS_METRIC, callbacks=[_observe_flags(state)], unit="{flag}",
                                    description="Flags the live detectors raised, by kind and severity")
    meter.create_observable_gauge(RINGS_REFUSED.name, callbacks=[_observe_refused(state)], unit=RINGS_REFUSED.unit,
                                  description=RINGS_REFUSED.description)
    for spec in BUNDLE_METRICS:
        makers[spec.kind](spec.name, callbacks=[_observe_bundles(state, spec)], unit=spec.unit,
                          description=spec.description)
