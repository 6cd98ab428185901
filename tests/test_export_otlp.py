"""OTLP end to end: a real ``memwatch serve --otlp`` pushes to a local receiver that decodes the protobuf.

Every exported number is checked against what the same sidecar stored in SQLite for the same run:
the last sample of each rank, the ledger ``memwatch check`` computes from the store, the counts of
samples, OOMs and flags, and one log record per stored flag. The exporting sidecar loads no PyTorch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memwatch.report.check import check_run
from memwatch.store import open_store

from otlp_receiver import OtlpReceiver
from processes import SidecarProcess, memwatch_env, query, wait_for

RUN_ATTRIBUTES = ("run_id", "rank", "engine", "model", "host", "pid")
CHECK_TERMS = ("budget_bytes", "non_torch_bytes", "weights_bytes", "torch_other_bytes", "kv_bytes",
               "activation_reserve_bytes", "headroom_bytes", "cache_slack_bytes", "reclaimable_cache_bytes",
               "pinned_cache_bytes", "torch_kept_bytes", "residual_bytes", "oom_margin_bytes")
"""Every ledger term ``memwatch check`` prints."""


def _simulate(runtime_dir: Path, db_path: Path, scenario: str) -> str:
    sim = subprocess.run([sys.executable, "-m", "memwatch", "sim", "--scenario", scenario, "--json"],
                         env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=120)
    assert sim.returncode == 0, sim.stderr
    run_id = json.loads(sim.stdout)["run_id"]
    wait_for(lambda: query(db_path, "SELECT status FROM runs WHERE run_id = ?", (run_id,))
             in ([("oom",)], [("ok",)], [("crashed",)]),
             timeout=60, what="the simulated run to be stored")
    return run_id


def _by_rank(points: list[tuple[dict, object, str]]) -> dict[int, tuple[dict, object, str]]:
    return {attrs["rank"]: (attrs, value, unit) for attrs, value, unit in points}


def test_otlp_metrics_and_flag_logs_match_the_store(runtime_dir: Path, db_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=gpu-team")
    with OtlpReceiver() as receiver, SidecarProcess(runtime_dir, db_path, "--otlp", receiver.endpoint) as sidecar:
        run_id = _simulate(runtime_dir, db_path, "non_torch_leak_tp2")
        mapped = Path(f"/proc/{sidecar.proc.pid}/maps").read_text()  # every exporter has run: no PyTorch loaded
        output = sidecar.stop()  # the last export happens on the way out, with the final counts
    assert "libtorch" not in mapped and "libc10" not in mapped
    assert sidecar.proc.returncode == 0, output
    assert f"exporting to OTLP/HTTP to {receiver.endpoint}" in output
    assert receiver.content_types == {"application/x-protobuf"}
    assert receiver.headers["x-tenant"] == "gpu-team"
    resource = receiver.resources()[-1]
    assert resource["service.name"] == "memwatch" and resource["deployment.environment"] == "ci"

    latest = receiver.latest_points()
    run = query(db_path, "SELECT engine, model, hostname, gpu_total_bytes FROM runs WHERE run_id = ?", (run_id,))[0]
    engine, model, host, total = run
    ranks = dict(query(db_path, "SELECT rank, pid FROM ranks WHERE run_id = ?", (run_id,)))
    gpu_names = dict(query(db_path, "SELECT rank, gpu_name FROM ranks WHERE run_id = ?", (run_id,)))
    assert sorted(ranks) == [0, 1]
    report = check_run(open_store(db_path, readonly=True), run_id)
    for rank, pid in ranks.items():
        last = query(db_path, "SELECT driver_used_bytes, allocated_bytes, reserved_bytes, peak_bytes FROM samples"
                     " WHERE run_id = ? AND rank = ? ORDER BY ts_ns DESC, step DESC LIMIT 1", (run_id, rank))[0]
        used, allocated, reserved, peak = last
        kv = query(db_path, "SELECT kv_blocks_used, kv_blocks_total FROM samples WHERE run_id = ?"
                   " AND rank = ? AND kv_blocks_total IS NOT NULL ORDER BY ts_ns DESC LIMIT 1", (run_id, rank))
        expected_run = {"run_id": run_id, "rank": rank, "engine": engine, "model": model, "host": host, "pid": pid}

        attrs, value, unit = _by_rank(latest["hw.gpu.memory.usage"])[rank]
        assert (value, unit) == (used, "By")
        assert {k: attrs[k] for k in RUN_ATTRIBUTES} == expected_run
        assert attrs["hw.type"] == "gpu" and attrs["hw.id"] == str(rank)  # the simulator puts rank r on GPU r
        assert attrs["hw.name"] == gpu_names[rank] == "Virtual GPU" and "hw.vendor" not in attrs  # no vendor named
        assert _by_rank(latest["hw.gpu.memory.limit"])[rank][1:] == (total, "By")
        _, ratio, unit = _by_rank(latest["hw.gpu.memory.utilization"])[rank]
        assert unit == "1" and ratio == pytest.approx(used / total)
        for name, stored in (("allocated", allocated), ("reserved", reserved), ("peak", peak)):
            attrs, value, unit = _by_rank(latest[f"memwatch.{name}"])[rank]
            assert (value, unit) == (stored, "By") and {k: attrs[k] for k in RUN_ATTRIBUTES} == expected_run

        terms = next(r for r in report.ranks if r.rank == rank).last_terms
        assert terms is not None
        for term in CHECK_TERMS:  # every term `memwatch check` prints, in bytes
            _, value, unit = _by_rank(latest["memwatch." + term.removesuffix("_bytes")])[rank]
            assert (value, unit) == (getattr(terms, term), "By"), term
        exported_kv = [_by_rank(latest[f"memwatch.kv.blocks.{which}"]).get(rank) for which in ("used", "capacity")]
        if kv:  # the simulator's scheduler (rank 0) reports the KV blocks; no series for a rank that does not
            assert [point[1:] for point in exported_kv] == [(kv[0][0], "{block}"), (kv[0][1], "{block}")]
        else:
            assert exported_kv == [None, None]

        samples = query(db_path, "SELECT count(*) FROM samples WHERE run_id = ? AND rank = ?", (run_id, rank))[0][0]
        assert _by_rank(latest["memwatch.samples"])[rank][1] == samples
        ooms = query(db_path, "SELECT count(*) FROM events WHERE run_id = ? AND rank = ? AND kind = 'oom'",
                     (run_id, rank))[0][0]
        assert _by_rank(latest["memwatch.ooms"])[rank][1] == ooms
        assert _by_rank(latest["memwatch.ring.records_lost"])[rank][1] == 0
        stored_flags = dict(((kind, severity), n) for kind, severity, n in query(
            db_path, "SELECT kind, severity, count(*) FROM flags WHERE run_id = ? AND rank = ? GROUP BY kind, severity",
            (run_id, rank)))
        exported_flags = {(a["kind"], a["severity"]): v for a, v, _ in latest["memwatch.flags"]
                          if a["rank"] == rank and v}
        assert exported_flags == stored_flags
        assert (rank == 0) == bool(kv)
    # The scenario's leak kills rank 1 outside PyTorch after serving a while: no oom event, only the risk.
    assert ooms == 0 and samples > 100

    stored = query(db_path, "SELECT rank, step, kind, severity, message, data FROM flags WHERE run_id = ?"
                   " ORDER BY ts_ns, rank", (run_id,))
    assert {kind for _, _, kind, _, _, _ in stored} >= {"non_torch_drift", "oom_risk"}
    records = receiver.log_records()
    exported = sorted((attrs["rank"], attrs["step"], attrs["kind"], attrs["severity"], r.body.string_value,
                       attrs["memwatch.flag.data"])
                      for r in records for attrs in [{kv.key: kv.value for kv in r.attributes}]
                      for attrs in [{k: getattr(v, v.WhichOneof("value")) for k, v in attrs.items()}])
    assert exported == sorted((rank, step, kind, severity, message, json.dumps(json.loads(data), sort_keys=True))
                              for rank, step, kind, severity, message, data in stored)
    severities = {r.severity_text for r in records}
    assert severities <= {"WARNING", "CRITICAL"} and "CRITICAL" in severities


def test_an_unreachable_collector_costs_one_line_and_nothing_of_ingest(runtime_dir: Path, db_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
    monkeypatch.setenv("OTEL_BLRP_SCHEDULE_DELAY", "100")  # flag log records are pushed (and fail) as often
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    with OtlpReceiver() as probe:
        port = probe.port  # a port that was free a moment ago and now has no listener
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")  # `--otlp` alone: the SDK's variable
    with SidecarProcess(runtime_dir, db_path, "--otlp") as sidecar:
        run_id = _simulate(runtime_dir, db_path, "non_torch_leak")
        samples = query(db_path, "SELECT count(*) FROM samples WHERE run_id = ?", (run_id,))[0][0]
        assert samples > 100
        time.sleep(3)  # several export periods fail (each gives up after the 1 s timeout) while the run is stored
        with OtlpReceiver(port) as receiver:  # the collector comes up: the next period gets through
            wait_for(lambda: "memwatch.samples" in receiver.latest_points(), timeout=20,
                     what="an export once the collector listens")
            output = sidecar.stop()
    assert sidecar.proc.returncode == 0, output
    assert f"exporting to OTLP/HTTP to http://127.0.0.1:{port}/v1/metrics" in output
    failing = [line for line in output.splitlines() if "otlp: cannot export metrics" in line]
    assert len(failing) == 1, output
    assert "ingest goes on" in failing[0] and "Traceback" not in output
    assert len([line for line in output.splitlines() if "otlp: cannot export flag log records" in line]) == 1, output
    assert "otlp: metrics reach" in output
    ((_, value, _),) = receiver.latest_points()["memwatch.samples"]
    assert value == samples
