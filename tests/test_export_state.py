"""What the sidecar exports, read through the real OpenTelemetry SDK (an in-memory reader).

Counts are checked against what the same collector stored; a finished rank's series linger, then
stop; options and their environment twins are parsed into exporters or refused in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from memwatch.errors import UsageError
from memwatch.export.config import OTLP_FROM_ENV, export_config, parse_listen
from memwatch.export.instruments import METRICS, register_instruments
from memwatch.export.state import ExportState
from memwatch.flags import FLAG_KINDS, SEVERITIES, Flag
from memwatch.sidecar.live import LiveDetectors
from memwatch.sim import run_scenario
from memwatch.store import open_store
from memwatch_engine.ring_reader import RingHeader

from processes import SidecarProcess, memwatch_env, query, wait_for
from prometheus_server import free_port
from stored_runs import store_rings, store_scenario
from synthetic import GiB, SyntheticRun


def _reader(state: ExportState) -> InMemoryMetricReader:
    reader = InMemoryMetricReader()
    register_instruments(MeterProvider(metric_readers=[reader]).get_meter("test"), state)
    return reader


def _points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    data = reader.get_metrics_data()
    if data is None:
        return {}
    return {m.name: [(dict(p.attributes), p.value) for p in m.data.data_points]
            for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def _header(run_id: str = "run-1", rank: int = 0) -> RingHeader:
    meta = {"engine": "nano-vllm", "model": "Qwen3-0.6B", "hostname": "node7", "device_index": 3,
            "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_total_bytes": 80 * GiB}
    return RingHeader(run_id=run_id, rank=rank, world_size=1, writer_pid=4321, writer_start=0,
                      capacity=1 << 16, created_ns=0, meta=meta)


def test_preemptions_samples_and_flags_count_what_the_collector_stored(runtime_dir: Path, db_path: Path) -> None:
    result = run_scenario("kv_pressure", runtime_dir=runtime_dir)
    state = ExportState()
    reader = _reader(state)
    store_rings(runtime_dir, db_path, observers=[state, LiveDetectors(on_flag=state.on_flag)])
    points = _points(reader)
    stored_preemptions = sum(json.loads(data)["count"] for (data,) in query(
        db_path, "SELECT data FROM events WHERE run_id = ? AND kind = 'preemption'", (result.run_id,)))
    assert stored_preemptions == result.preemptions > 0
    ((_, preemptions),) = points["memwatch.preemptions"]
    assert preemptions == stored_preemptions
    ((_, samples),) = points["memwatch.samples"]
    assert samples == query(db_path, "SELECT count(*) FROM samples")[0][0]
    ((_, arrived),) = points["memwatch.requests.arrived"]
    assert arrived == 32  # the scenario's 32 requests, each taken in once (a preempted one is not new)
    flags = {(a["kind"], a["severity"]): v for a, v in points["memwatch.flags"] if v}
    assert flags == {(k, s): n for k, s, n in query(db_path, "SELECT kind, severity, count(*) FROM flags"
                                                              " GROUP BY kind, severity")}
    assert ("kv_pressure", "warning") in flags
    zeros = [(a["kind"], a["severity"]) for a, v in points["memwatch.flags"] if not v]
    assert ("oom", "critical") in zeros  # every kind starts at 0, so a rate sees the first flag


def test_an_oom_is_counted_on_its_rank(runtime_dir: Path, db_path: Path) -> None:
    run_scenario("warmup_decode", runtime_dir=runtime_dir)  # the 16,384-token wave runs out of memory
    state = ExportState()
    reader = _reader(state)
    store_rings(runtime_dir, db_path, observers=[state, LiveDetectors(on_flag=state.on_flag)])
    stored = query(db_path, "SELECT count(*) FROM events WHERE kind = 'oom'")[0][0]
    assert stored == 1
    ((_, ooms),) = _points(reader)["memwatch.ooms"]
    assert ooms == stored
    flags = {(a["kind"], a["severity"]): v for a, v in _points(reader)["memwatch.flags"]}
    assert flags[("oom", "critical")] == 1


def test_hardware_attributes_and_a_finished_rank_lingers_then_stops() -> None:
    now = [100.0]
    state = ExportState(linger=30, clock=lambda: now[0])
    reader = _reader(state)
    run = SyntheticRun(jitter=False, serve_steps=50)
    header = _header()
    state(header, list(run.records()))
    [(attrs, used)] = _points(reader)["hw.gpu.memory.usage"]
    assert attrs == {"run_id": "run-1", "rank": 0, "engine": "nano-vllm", "model": "Qwen3-0.6B", "host": "node7",
                     "pid": 4321, "hw.id": "3", "hw.type": "gpu", "hw.name": "NVIDIA H100 80GB HBM3",
                     "hw.vendor": "NVIDIA"}
    last = [r for r in run.records() if type(r).__name__ == "Sample"][-1]
    assert used == last.driver_used_bytes
    [(_, limit)] = _points(reader)["hw.gpu.memory.limit"]
    assert limit == 80 * GiB
    state.finished(header)
    now[0] += 29
    assert "memwatch.samples" in _points(reader)  # a scrape or export in the linger still sees the final counts
    now[0] += 2
    points = _points(reader)
    assert all(not series for series in points.values())


def test_ring_losses_are_counted_per_rank() -> None:
    state = ExportState()
    reader = _reader(state)
    state(_header(rank=0), list(SyntheticRun(jitter=False, serve_steps=5).records()))
    state(_header(rank=1), list(SyntheticRun(jitter=False, serve_steps=5, rank=1).records()))
    state.set_lost_records(lambda: [("run-1", 0, 0), ("run-1", 1, 17)])
    lost = {a["rank"]: v for a, v in _points(reader)["memwatch.ring.records_lost"]}
    assert lost == {0: 0, 1: 17}


@pytest.mark.parametrize(("value", "expected"), [
    ("9464", ("127.0.0.1", 9464)), ("0.0.0.0:9100", ("0.0.0.0", 9100)), ("[::1]:9464", ("::1", 9464)),
    (":0", ("127.0.0.1", 0)),
])
def test_listen_addresses(value: str, expected: tuple[str, int]) -> None:
    assert parse_listen(value) == expected


@pytest.mark.parametrize("value", ["http", "host:99999", "", "9464:x"])
def test_bad_listen_addresses_are_refused(value: str) -> None:
    with pytest.raises(UsageError, match="is not \\[HOST:\\]PORT"):
        parse_listen(value)


def test_options_fall_back_to_the_environment() -> None:
    assert not export_config(env={}).enabled
    config = export_config(env={"MEMWATCH_PROMETHEUS": "9100", "MEMWATCH_OTLP": "http://otel:4318/",
                                "MEMWATCH_CONSOLE": "1", "MEMWATCH_EXPORT_LINGER": "5"})
    assert (config.prometheus, config.otlp, config.console, config.linger) == (
        ("127.0.0.1", 9100), "http://otel:4318", True, 5.0)
    assert export_config("9200", env={"MEMWATCH_PROMETHEUS": "9100"}).prometheus == ("127.0.0.1", 9200)
    assert export_config(otlp="1", env={}).otlp == OTLP_FROM_ENV
    standard = export_config(env={"OTEL_METRICS_EXPORTER": "otlp,prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "9300"})
    assert (standard.prometheus, standard.otlp, standard.console) == (("127.0.0.1", 9300), OTLP_FROM_ENV, False)
    with pytest.raises(UsageError, match="OTEL_METRICS_EXPORTER names zipkin"):
        export_config(env={"OTEL_METRICS_EXPORTER": "zipkin"})
    with pytest.raises(UsageError, match="is not an http:// or https:// URL"):
        export_config(otlp="otel:4318", env={})


def test_serve_refuses_a_bad_address_and_a_taken_port_in_one_line(runtime_dir: Path, db_path: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "memwatch", "serve", *args],
                              env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=30)

    bad = serve("--prometheus", "localhost:http")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --prometheus 'localhost:http' is not")
    port = free_port()
    with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port)) as first:
        other_runtime = runtime_dir.parent / "other"
        other_runtime.mkdir(mode=0o700)
        taken = serve("--prometheus", str(port), "--runtime-dir", str(other_runtime))
        first.stop()
    assert taken.returncode == 4, taken.stderr
    assert taken.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port} for --prometheus: Address already in use; pass another [HOST:]PORT"]


def test_the_environment_configures_a_sidecar_started_without_options(runtime_dir: Path, db_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("MEMWATCH_PROMETHEUS", str(port))
    monkeypatch.setenv("MEMWATCH_CONSOLE", "1")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sim = subprocess.run([sys.executable, "-m", "memwatch", "sim", "--scenario", "clean_chat", "--json"],
                             env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=120)
        run_id = json.loads(sim.stdout)["run_id"]
        wait_for(lambda: query(db_path, "SELECT status FROM runs WHERE run_id = ?", (run_id,)) == [("ok",)],
                 what="the run to be stored")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            scraped = response.read().decode()
        output = sidecar.stop()
    samples = query(db_path, "SELECT count(*) FROM samples WHERE run_id = ?", (run_id,))[0][0]
    line = next(line for line in scraped.splitlines() if line.startswith("memwatch_samples_total{"))
    assert f'run_id="{run_id}"' in line and float(line.rsplit(" ", 1)[1]) == samples
    assert "hw_gpu_memory_usage_bytes{" in scraped and "memwatch_budget_bytes{" in scraped
    assert '"name": "hw.gpu.memory.usage"' in output  # the console exporter's JSON on stdout


def test_the_scrape_has_the_names_labels_and_values_of_opentelemetry_s_prometheus_exporter() -> None:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from memwatch.export.headroom import HELP as HEADROOM_HELP
    from memwatch.export.prometheus import render

    state = ExportState()
    for rank in range(2):
        state(_header(rank=rank), list(SyntheticRun(jitter=False, serve_steps=40, rank=rank).records()))
    state.on_flag(Flag("run-1", 1, 30, 0, "fragmentation", "warning", "slack grew", {}))
    registry = CollectorRegistry()
    reference = PrometheusMetricReader(scope_info_enabled=False, disable_target_info=True, registry=registry)
    register_instruments(MeterProvider(metric_readers=[reference]).get_meter("memwatch"), state)

    def samples(text: str) -> set[tuple[str, frozenset, float]]:
        return {(s.name, frozenset(s.labels.items()), s.value)
                for family in text_string_to_metric_families(text) for s in family.samples}

    def without_dcgm(found: set[tuple[str, frozenset, float]]) -> set[tuple[str, frozenset, float]]:
        """Ours less dcgm-exporter's GPU labels, which only the Prometheus scrape adds (for joins on UUID)."""
        assert all(dict(labels).get("gpu_name") == "NVIDIA H100 80GB HBM3" for _, labels, _ in found)
        return {(name, frozenset((k, v) for k, v in labels if k != "gpu_name"), value)
                for name, labels, value in found}

    headroom = set(HEADROOM_HELP)  # engine-level gauges for routers, on /metrics only (docs/routing.md)
    rendered = {sample for sample in samples(render(state)) if sample[0] not in headroom}
    ours, theirs = without_dcgm(rendered), samples(generate_latest(registry).decode())
    assert ours == theirs
    per_rank = len(METRICS) + len(FLAG_KINDS) * len(SEVERITIES)  # every metric, and the flags by kind and severity
    assert len(ours) == 2 * per_rank
    names = {name for name, _, _ in ours}
    assert {"hw_gpu_memory_usage_bytes", "memwatch_budget_bytes", "memwatch_flags_total"} <= names
    assert ("memwatch_flags_total", frozenset({**{k: str(v) for k, v in _attrs(1).items()}, "kind": "fragmentation",
                                               "severity": "warning"}.items()), 1.0) in ours


def _attrs(rank: int) -> dict[str, Any]:
    return {"run_id": "run-1", "rank": rank, "engine": "nano-vllm", "model": "Qwen3-0.6B", "host": "node7",
            "pid": 4321}


def test_every_term_the_check_prints_is_exported_in_bytes(runtime_dir: Path, db_path: Path) -> None:
    from memwatch.report.check import check_run, render_check
    from memwatch.report.ledger_text import terms_lines

    run_id = store_scenario("demo", runtime_dir, db_path)
    report = check_run(open_store(db_path, readonly=True), run_id)
    printed = render_check(report)
    labels = [line.label for line in terms_lines(report.ranks[0].last_terms)]
    assert all(label in printed for label in labels)
    exported = {spec.name: spec for spec in METRICS if spec.name.startswith("memwatch.")}
    assert len(labels) == len([s for s in exported.values() if s.description.startswith("Ledger: ")])
    for label in labels:
        spec = next(s for s in exported.values() if s.description.startswith(f"Ledger: {label.strip()}"))
        assert spec.unit == "By"


def test_with_detectors_the_exporters_read_their_ledger_and_get_the_same_terms() -> None:
    live = LiveDetectors()
    shared = ExportState()
    shared.set_terms_source(live.last_terms)
    own = ExportState()
    header = _header()
    records = list(SyntheticRun(jitter=False, serve_steps=30).records())
    assert live.last_terms("run-1", 0) is None and live.last_terms("run-1", 5) is None
    shared(header, records)
    live(header, records)
    own(header, records)
    [terms_shared], [terms_own] = [s.terms for s in shared.snapshot()], [s.terms for s in own.snapshot()]
    assert terms_shared is not None and terms_shared == terms_own
    assert terms_shared.budget_bytes is not None and terms_shared.headroom_bytes is not None


def test_wired_as_the_sidecar_wires_them_the_exporters_count_from_the_ring_as_they_do_from_typed_records(
        runtime_dir: Path, db_path: Path) -> None:
    """With the detectors' ledger as the terms source, the exporters are handed the ring's own tuples and keep
    only a drain's last sample and its events: every series equals what typed records of the same drains give."""
    run_scenario("kv_pressure", runtime_dir=runtime_dir)
    typed = ExportState()

    class TypedCopy:  # the same drains as typed records, into a second state
        def __call__(self, header: RingHeader, records: list[Any]) -> tuple[()]:
            return typed(header, records)

        def finished(self, header: RingHeader) -> None:
            typed.finished(header)

    live = LiveDetectors()
    drained = ExportState()
    drained.set_terms_source(live.last_terms)
    typed.set_terms_source(live.last_terms)
    reader, reader_typed = _reader(drained), _reader(typed)
    store_rings(runtime_dir, db_path, observers=[drained, TypedCopy(), live])
    points, points_typed = _points(reader), _points(reader_typed)
    assert points == points_typed
    ((_, samples),) = points["memwatch.samples"]
    assert samples == query(db_path, "SELECT count(*) FROM samples")[0][0]
    ((_, preemptions),) = points["memwatch.preemptions"]
    assert preemptions == sum(json.loads(data)["count"] for (data,) in query(
        db_path, "SELECT data FROM events WHERE kind = 'preemption'")) > 0
    last_kv = query(db_path, "SELECT kv_blocks_used, kv_blocks_total FROM samples WHERE kv_blocks_total IS NOT NULL"
                             " ORDER BY ts_ns DESC LIMIT 1")[0]
    assert [value for _, value in points["memwatch.kv.blocks.used"]] == [last_kv[0]]
