"""Plan versus observed: each ledger term's difference and its cause, from dicts and from a real SQLite file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memwatch.errors import NotFoundError, StoreError
from memwatch.models import ModelSpec, forward_activation_bytes
from memwatch.plan import PlanError
from memwatch.plan.observed import compare_run
from memwatch.plan.runs import load_run
from memwatch.store import open_store

GIB, MIB = 2**30, 2**20
TOTAL = 80 * GIB
BLOCK = 14_680_064
QWEN = ModelSpec.load("Qwen2.5-7B-Instruct")
WEIGHTS = QWEN.weight_bytes()                                          # 15,231,233,024
RESERVE = forward_activation_bytes(QWEN, 16_384, 4, prefill=True)      # warmup: 4 × 4,096 tokens
CONFIG = {"model_config": "Qwen2.5-7B-Instruct", "gpu_memory_utilization": 0.9, "block_size": 256,
          "max_num_batched_tokens": 16_384, "max_num_seqs": 512, "max_model_len": 4096,
          "tensor_parallel_size": 1, "dtype": "bfloat16", "kv_cache_dtype": "auto"}
CONTEXT = 512 * MIB                                                    # the plan's estimate: one CUDA context
PLANNED_BLOCKS = (int(TOTAL * 0.9) - CONTEXT - WEIGHTS - RESERVE) // BLOCK


def sizing(current: int, peak: int, used: int, block_bytes: int = BLOCK) -> dict[str, Any]:
    """A kv_allocated event's data, with num_blocks computed as the engine does."""
    return {"total_bytes": TOTAL, "gpu_memory_utilization": 0.9, "used_bytes": used, "peak_bytes": peak,
            "current_bytes": current, "reserved_bytes": current, "block_bytes": block_bytes,
            "num_blocks": int(TOTAL * 0.9 - used - peak + current) // block_bytes}


def run_row(config: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"run_id": "r1", "model": "Qwen/Qwen2.5-7B-Instruct", "config": json.dumps(config or CONFIG)}


def event(data: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    return {"run_id": "r1", "rank": rank, "step": 0, "ts_ns": 1, "kind": "kv_allocated", "data": data}


def test_a_run_that_matches_the_plan() -> None:
    [result] = compare_run(run_row(), [event(sizing(WEIGHTS, WEIGHTS + RESERVE, WEIGHTS + CONTEXT))])
    assert PLANNED_BLOCKS == 4041                                     # 4,077 if nothing lived outside PyTorch
    assert [(t.term, t.diff_bytes, t.cause) for t in result.terms] == [
        ("weights", 0, "as planned"), ("activation reserve", 0, "as planned"),
        ("non-PyTorch", 0, "as planned"), ("cache slack", 0, "as planned"), ("KV blocks", 0, "as planned")]
    kv = result.terms[-1]
    assert (kv.predicted_blocks, kv.measured_blocks) == (4041, 4041)
    assert (result.warmup_seqs, result.warmup_seq_len, result.model) == (4, 4096, "Qwen2.5-7B-Instruct")


def test_load_spike_and_cuda_context_come_out_of_the_kv_cache() -> None:
    current = WEIGHTS + 50 * MIB                      # within 1% of the weights: as planned
    peak = current + RESERVE + 3 * GIB                # peak not reset after loading
    used = current + 700 * MIB                        # CUDA context and workspaces
    [result] = compare_run(run_row(), [event(sizing(current, peak, used))])
    weights, reserve, non_torch, _slack, kv = result.terms
    assert (weights.diff_bytes, weights.cause) == (50 * MIB, "as planned")
    assert reserve.diff_bytes == 3 * GIB and "peak was not reset before warmup" in reserve.cause
    assert (non_torch.predicted_bytes, non_torch.measured_bytes) == (CONTEXT, 700 * MIB)
    assert "more than the estimate of the CUDA context" in non_torch.cause
    measured_blocks = int(TOTAL * 0.9 - used - peak + current) // BLOCK
    assert (kv.predicted_blocks, kv.measured_blocks) == (PLANNED_BLOCKS, measured_blocks)
    assert kv.diff_bytes == (measured_blocks - PLANNED_BLOCKS) * BLOCK
    assert "3.23 GiB beyond the plan" in kv.cause  # 50 MiB + 3 GiB + (700 − 512) MiB


def test_a_small_warmup_understates_the_reserve() -> None:
    small = forward_activation_bytes(QWEN, 512, 1, prefill=True)
    [result] = compare_run(run_row(), [event(sizing(WEIGHTS, WEIGHTS + small, WEIGHTS))])
    reserve = result.terms[1]
    assert reserve.diff_bytes == small - RESERVE < 0
    assert "smaller batch or a decode step" in reserve.cause
    assert "4 × 4,096-token prefill" in reserve.cause


def test_block_bytes_that_differ_name_the_kv_dtype() -> None:
    data = sizing(WEIGHTS, WEIGHTS + RESERVE, WEIGHTS + CONTEXT, block_bytes=BLOCK // 2)
    [result] = compare_run(run_row(), [event(data)])
    kv = result.terms[-1]
    assert (result.predicted_block_bytes, result.measured_block_bytes) == (BLOCK, BLOCK // 2)
    assert "block_size or the KV dtype differs" in kv.cause
    assert kv.measured_blocks == 2 * PLANNED_BLOCKS       # the same bytes hold twice the half blocks


def test_explicit_kv_size_replaces_the_utilization_budget() -> None:
    config = {**CONFIG, "kv_cache_memory_bytes": 10 * GIB}
    data = {**sizing(WEIGHTS, WEIGHTS + RESERVE, WEIGHTS), "num_blocks": 10 * GIB // BLOCK}
    [result] = compare_run(run_row(config), [event(data)])
    assert result.terms[-1].predicted_blocks == 10 * GIB // BLOCK == 731
    assert result.terms[-1].cause == "as planned"


def test_one_comparison_per_rank_from_its_last_sizing() -> None:
    first = sizing(WEIGHTS, WEIGHTS + RESERVE, WEIGHTS + GIB)
    last = sizing(WEIGHTS, WEIGHTS + RESERVE, WEIGHTS)
    results = compare_run(run_row(), [event(first, rank=1), event(last, rank=1), event(last, rank=0)])
    assert [(r.rank, r.terms[2].measured_bytes) for r in results] == [(0, 0), (1, 0)]


def test_runs_without_sizing_or_fields_are_refused() -> None:
    with pytest.raises(PlanError, match="no kv_allocated event"):
        compare_run(run_row(), [{"kind": "weights_loaded", "rank": 0, "data": {}}])
    with pytest.raises(PlanError, match="lacks used_bytes, num_blocks"):
        data = sizing(WEIGHTS, WEIGHTS, WEIGHTS)
        del data["used_bytes"], data["num_blocks"]
        compare_run(run_row(), [event(data)])
    with pytest.raises(PlanError, match="neither a model_config nor a model"):
        compare_run({"run_id": "r1", "config": "{}"}, [event(sizing(WEIGHTS, WEIGHTS, WEIGHTS))])


# --------------------------------------------------------------------------------- a real SQLite file


def make_store(path: Path, runs: list[tuple[str, int, dict[str, Any]]],
               events: list[tuple[str, int, str, dict[str, Any]]]) -> None:
    db = open_store(path)  # the real schema, as the sidecar creates it
    connection = db.conn
    for run_id, started_ns, config in runs:
        connection.execute("INSERT INTO runs (run_id, pid, hostname, engine, model, rank_count, started_ns,"
                           " status, gpu_name, gpu_total_bytes, config) VALUES (?, 1, 'host', 'sim',"
                           " 'Qwen2.5-7B-Instruct', 1, ?, 'running', 'Simulated', ?, ?)",
                           (run_id, started_ns, TOTAL, json.dumps(config)))
    for run_id, ts_ns, kind, data in events:
        connection.execute("INSERT INTO events VALUES (?, 0, 0, ?, ?, ?)", (run_id, ts_ns, kind, json.dumps(data)))
    connection.commit()
    connection.close()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "memwatch.db"
    make_store(path, runs=[("old", 100, CONFIG), ("new", 200, CONFIG)], events=[
        ("new", 5, "weights_loaded", {"weights_bytes": WEIGHTS}),
        ("new", 6, "kv_allocated", sizing(WEIGHTS, WEIGHTS + RESERVE + GIB, WEIGHTS + 500 * MIB)),
        ("old", 7, "kv_allocated", sizing(WEIGHTS, WEIGHTS + RESERVE, WEIGHTS)),
    ])
    return path


def test_load_run_reads_latest_and_by_id(store: Path) -> None:
    record, events = load_run(store, "latest")
    assert record["run_id"] == "new" and record["config"] == CONFIG
    assert [e["kind"] for e in events] == ["weights_loaded", "kv_allocated"]
    assert events[1]["data"]["current_bytes"] == WEIGHTS
    record, events = load_run(store, "old")
    assert record["run_id"] == "old" and len(events) == 1
    [result] = compare_run(*load_run(store, "new"))
    assert result.terms[1].diff_bytes == GIB and result.terms[2].measured_bytes == 500 * MIB


def test_load_run_errors(store: Path, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no run 'missing'"):
        load_run(store, "missing")
    with pytest.raises(NotFoundError, match="no memwatch database"):
        load_run(tmp_path / "absent.db", "latest")
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="not a usable memwatch database"):
        load_run(garbage, "latest")
    empty = tmp_path / "empty.db"
    make_store(empty, runs=[], events=[])
    with pytest.raises(NotFoundError, match="has no runs yet"):
        load_run(empty, "latest")


def test_the_store_is_opened_read_only(store: Path) -> None:
    before = store.read_bytes()
    load_run(store, "latest")
    assert store.read_bytes() == before
    assert not store.with_name(store.name + "-journal").exists()
