"""Which ranks of a stored run hold CUDA graphs outside their engine's KV budget, read from the store and from a
replay of the same records: nano-vllm sizes its KV cache, then captures its graphs, so the first serving sample
holds them beyond the weights at sizing and the KV cache."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from memwatch.report.graphs import graphs_per_rank, replayed_graphs_outside_budget, stored_graphs_outside_budget
from memwatch.store import open_store
from memwatch.store.run_model import StoredRun, load_run

from processes import query
from stored_runs import store_scenario


def _stored(tmp_path: Path, name: str) -> tuple[Path, StoredRun]:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db = tmp_path / "m.db"
    run_id = store_scenario(name, runtime, db, live=True)
    return db, load_run(open_store(db, readonly=True), run_id)


def _graphs(db: Path) -> int:
    """Allocated at the first serving sample less ``current`` at sizing and the KV cache."""
    [(data,)] = query(db, "SELECT data FROM events WHERE kind = 'kv_allocated'")
    sizing = json.loads(data)
    [(allocated,)] = query(db, "SELECT allocated_bytes FROM sample_rows WHERE phase = 'serve' ORDER BY ts_ns, seq "
                               "LIMIT 1")
    return allocated - sizing["current_bytes"] - sizing["num_blocks"] * sizing["block_bytes"]


def test_nano_vllms_graphs_are_outside_its_budget_read_stored_or_replayed(tmp_path: Path) -> None:
    db, model = _stored(tmp_path, "demo")
    graphs = _graphs(db)
    assert graphs == 385_628_160  # 367.8 MiB of graphs' buffers and pool
    assert stored_graphs_outside_budget(model) == {0: graphs}
    assert replayed_graphs_outside_budget("nano-vllm", model.summaries, model.events) == {0: graphs}
    for engine in ("vllm", "sglang", None):
        assert replayed_graphs_outside_budget(engine, model.summaries, model.events) == {}
    # An engine that counts its graphs in its budget has none outside it.
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE runs SET engine = 'vllm'")
    assert stored_graphs_outside_budget(load_run(open_store(db, readonly=True), model.run_id)) == {}


def test_graphs_are_not_named_where_more_than_they_grew(tmp_path: Path) -> None:
    # torch_leak: nano-vllm's graphs, then PyTorch memory kept across steps far beyond them (a leak, not graphs).
    db, model = _stored(tmp_path, "torch_leak")
    assert _graphs(db) > 0 and model.summaries[0].last_terms.torch_kept_bytes > 2 * _graphs(db)
    assert stored_graphs_outside_budget(model) == {}
    assert replayed_graphs_outside_budget("nano-vllm", model.summaries, model.events) == {}


def test_each_rank_is_judged_by_its_own_capture_in_rank_order(tmp_path: Path) -> None:
    db, model = _stored(tmp_path, "kv_pressure")
    summary, [capture] = model.summaries[0], model.capture_ns.values()
    graphs = _graphs(db)
    found = graphs_per_rank("nano-vllm", {2: summary, 0: summary, 1: summary}, {0: capture, 2: capture})
    assert list(found.items()) == [(0, graphs), (2, graphs)]
    # A capture before the sizing is not after it: those graphs are in the budget's measurement.
    assert graphs_per_rank("nano-vllm", {0: summary}, {0: summary.sizing.ts_ns - 1}) == {}
    assert graphs_per_rank("nano-vllm", {0: summary}, {0: summary.sizing.ts_ns}) == {0: graphs}
