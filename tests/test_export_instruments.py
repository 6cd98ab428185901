"""Each exported instrument as the OpenTelemetry SDK collects it (an in-memory reader): its kind, unit and
description, which attributes its points carry, what a rank without a reading leaves out, and the sidecar-wide
series (incident bundles, refused rings) present only while something feeds them.

The values are worked out by hand from one sample fed to the state: 20 GiB of an 80 GiB GPU in use is a
utilization of 0.25.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, InMemoryMetricReader, Metric, Sum

from memwatch.export.instruments import (
    BUNDLE_METRICS,
    FLAGS_METRIC,
    LEDGER_METRICS,
    METRICS,
    PRINTED_TERMS,
    RINGS_REFUSED,
    _sample_field,
    _term,
    ledger_metric_name,
    register_instruments,
)
from memwatch.export.state import ExportState, RankSeries
from memwatch.records import Sample
from memwatch_engine.ring_reader import RingHeader

from synthetic import GiB, SyntheticRun

RUN = {"run_id": "run-1", "rank": 0, "engine": "vllm", "model": "Qwen3-0.6B", "host": "node7", "pid": 4321}
HARDWARE = {"hw.id": "2", "hw.type": "gpu", "hw.name": "NVIDIA H100 80GB HBM3", "hw.vendor": "NVIDIA"}
SAMPLE = Sample("run-1", 0, 5, 0, "serve", allocated_bytes=10 * GiB, peak_bytes=12 * GiB, reserved_bytes=11 * GiB,
                driver_used_bytes=20 * GiB, driver_free_bytes=60 * GiB, kv_blocks_used=30, kv_blocks_total=400)


def _header(total: int | None = 80 * GiB) -> RingHeader:
    meta: dict[str, Any] = {"engine": "vllm", "model": "Qwen3-0.6B", "hostname": "node7", "device_index": 2,
                            "gpu_name": "NVIDIA H100 80GB HBM3"}
    if total is not None:
        meta["gpu_total_bytes"] = total
    return RingHeader(run_id="run-1", rank=0, world_size=1, writer_pid=4321, writer_start=0, capacity=1 << 16,
                      created_ns=0, meta=meta)


def _metrics(state: ExportState) -> dict[str, Metric]:
    reader = InMemoryMetricReader()
    register_instruments(MeterProvider(metric_readers=[reader]).get_meter("test"), state)
    data = reader.get_metrics_data()  # None: not a single point
    return {} if data is None else {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics
                                    for m in sm.metrics}


def _points(metric: Metric) -> list[tuple[dict[str, Any], Any]]:
    return [(dict(p.attributes), p.value) for p in metric.data.data_points]


def _kind(metric: Metric) -> str:
    data = metric.data
    if isinstance(data, Gauge):
        return "gauge"
    assert isinstance(data, Sum)
    return "counter" if data.is_monotonic else "updown"


def test_every_instrument_has_its_kind_unit_and_description() -> None:
    state = ExportState()
    state(_header(), list(SyntheticRun(jitter=False, serve_steps=20).records()))  # a ledger for every term
    state.set_refused_rings(lambda: {"mode": 0})
    state.set_bundle_counts(lambda: dict.fromkeys(("built", "shipped", "failed", "dropped", "spool_bytes",
                                                    "spool_bundles"), 0))
    metrics = _metrics(state)
    for spec in (*METRICS, *BUNDLE_METRICS, RINGS_REFUSED):
        metric = metrics[spec.name]
        assert (_kind(metric), metric.unit, metric.description) == (spec.kind, spec.unit, spec.description)
    flags = metrics[FLAGS_METRIC]
    assert (_kind(flags), flags.unit, flags.description) == (
        "counter", "{flag}", "Flags the live detectors raised, by kind and severity")
    assert (_kind(metrics["hw.gpu.memory.usage"]), _kind(metrics["memwatch.allocated"]),
            _kind(metrics["memwatch.preemptions"])) == ("updown", "gauge", "counter")


def test_a_sample_s_readings_and_only_the_hardware_metrics_carry_the_gpu_s_attributes() -> None:
    state = ExportState()
    state(_header(), [SAMPLE])
    metrics = _metrics(state)
    values = {name: _points(metrics[name]) for name in (
        "hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.memory.utilization", "memwatch.allocated",
        "memwatch.reserved", "memwatch.peak", "memwatch.kv.blocks.used", "memwatch.kv.blocks.capacity")}
    hw = {**RUN, **HARDWARE}
    assert values == {
        "hw.gpu.memory.usage": [(hw, 20 * GiB)], "hw.gpu.memory.limit": [(hw, 80 * GiB)],
        "hw.gpu.memory.utilization": [(hw, 0.25)],
        "memwatch.allocated": [(RUN, 10 * GiB)], "memwatch.reserved": [(RUN, 11 * GiB)],
        "memwatch.peak": [(RUN, 12 * GiB)],
        "memwatch.kv.blocks.used": [(RUN, 30)], "memwatch.kv.blocks.capacity": [(RUN, 400)],
    }


def test_without_the_gpu_s_size_the_limit_is_used_plus_free_and_without_a_reading_nothing_is_guessed() -> None:
    state = ExportState()
    state(_header(total=None), [SAMPLE])
    metrics = _metrics(state)
    assert _points(metrics["hw.gpu.memory.limit"]) == [({**RUN, **HARDWARE}, 80 * GiB)]  # 20 + 60 GiB
    assert _points(metrics["hw.gpu.memory.utilization"]) == [({**RUN, **HARDWARE}, 0.25)]
    # A rank seen but not read yet: its counters are 0, while no reading and no ledger term is made up.
    fresh = ExportState()
    fresh(_header(total=None), [])
    metrics = _metrics(fresh)
    assert _points(metrics["memwatch.samples"]) == [(RUN, 0)]
    read = {spec.name for spec in METRICS if spec.kind != "counter"}  # every reading and ledger term
    assert read and not read & {name for name, metric in metrics.items() if _points(metric)}


def test_a_gpu_of_unknown_size_has_no_utilization() -> None:
    state = ExportState()
    state(_header(total=None), [SAMPLE._replace(driver_free_bytes=None)])
    metrics = _metrics(state)
    assert _points(metrics["hw.gpu.memory.usage"]) == [({**RUN, **HARDWARE}, 20 * GiB)]
    assert "hw.gpu.memory.limit" not in metrics and "hw.gpu.memory.utilization" not in metrics


def test_the_ledger_metrics_are_named_after_the_printed_terms() -> None:
    assert ledger_metric_name("budget_bytes") == "memwatch.budget"
    assert ledger_metric_name("headroom_bytes") == "memwatch.headroom"
    assert ledger_metric_name("kv_cache") == "memwatch.kv_cache"  # only a trailing _bytes goes
    assert [spec.name for spec in LEDGER_METRICS] == ["memwatch." + term[: -len("_bytes")] for term, _ in PRINTED_TERMS]
    assert [spec.description for spec in LEDGER_METRICS] == [f"Ledger: {label}" for _, label in PRINTED_TERMS]
    assert LEDGER_METRICS[0].name == "memwatch.budget" and LEDGER_METRICS[0].unit == "By"


def test_a_reader_takes_its_field_from_the_last_sample_and_its_term_from_the_ledger() -> None:
    series = RankSeries(attributes=dict(RUN), hardware=dict(HARDWARE), total_bytes=None)
    assert _sample_field("reserved_bytes")(series) is None and _term("budget_bytes")(series) is None
    series.last = SAMPLE
    assert _sample_field("reserved_bytes")(series) == 11 * GiB
    assert _sample_field("kv_blocks_total")(series) == 400
    state = ExportState()
    state(_header(), list(SyntheticRun(jitter=False, serve_steps=20).records()))
    [fed] = state.snapshot()
    assert fed.terms is not None
    assert _term("budget_bytes")(fed) == fed.terms.budget_bytes
    assert _term("headroom_bytes")(fed) == fed.terms.headroom_bytes
    points = _metrics(state)
    assert _points(points["memwatch.budget"]) == [(fed.attributes, fed.terms.budget_bytes)]


BUNDLES = {"built": 3, "shipped": 2, "failed": 1, "dropped": 4, "spool_bytes": 5000, "spool_bundles": 6}


def test_the_bundle_series_exist_only_while_a_sidecar_builds_bundles_and_read_its_counts(
        caplog: pytest.LogCaptureFixture) -> None:
    state = ExportState()
    state(_header(), [SAMPLE])
    with caplog.at_level(logging.WARNING):
        assert not any(name.startswith("memwatch.bundles.") for name in _metrics(state))
    assert caplog.records == []  # left out, not a callback that failed
    counts = dict(BUNDLES)
    state.set_bundle_counts(lambda: dict(counts))
    reader = InMemoryMetricReader()
    register_instruments(MeterProvider(metric_readers=[reader]).get_meter("test"), state)

    def collect() -> dict[str, list[tuple[dict[str, Any], Any]]]:
        data = reader.get_metrics_data()
        assert data is not None
        return {m.name: _points(m) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                if m.name.startswith("memwatch.bundles.")}

    assert collect() == {
        "memwatch.bundles.built": [({}, 3)], "memwatch.bundles.shipped": [({}, 2)],
        "memwatch.bundles.failed": [({}, 1)], "memwatch.bundles.dropped": [({}, 4)],
        "memwatch.bundles.spooled.size": [({}, 5000)], "memwatch.bundles.spooled": [({}, 6)],
    }
    counts.update(built=5, spool_bundles=0)  # each collection reads the counts anew
    found = collect()
    assert (found["memwatch.bundles.built"], found["memwatch.bundles.spooled"]) == ([({}, 5)], [({}, 0)])


@pytest.mark.parametrize("source", [None, {}])
def test_no_refused_rings_series_without_a_source_or_a_reason(source: dict[str, int] | None) -> None:
    state = ExportState()
    if source is not None:
        state.set_refused_rings(lambda: source)
    metrics = _metrics(state)
    assert RINGS_REFUSED.name not in metrics or _points(metrics[RINGS_REFUSED.name]) == []
