"""The read model of a stored run, on a small run written row by row: every figure derived by hand.

Two ranks on 8 GiB devices, both sized alike at t = 100 (used 2 GiB, reserved 1.5 GiB, peak 1.75 GiB, current
1 GiB, 100 blocks of 2 MiB): non-PyTorch at sizing 512 MiB, KV 200 MiB and an activation reserve of 768 MiB per
rank. Samples hold no cache slack (reserved = allocated) and no allocator signals, so the ledger's margin is
``free − 768 MiB``. Rank 0 (weights 900 MiB) ends with 5 GiB free: margin 4,352 MiB. Rank 1 (no weights event:
current at sizing, 1 GiB) runs out of memory at step 7 with 3 GiB free: its margin at the end is 0. The run's
figures are therefore rank 1's: out of memory at step 7, margin 0, worst rank 1.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from memwatch.store import open_store
from memwatch.store.db import Database
from memwatch.store.run_model import WINDOW_STEPS, load_run, load_runs
from memwatch.store.schema import ENSURE_RUN

MIB = 1 << 20
GIB = 1 << 30
SIZING = {"total_bytes": 8 * GIB, "gpu_memory_utilization": 0.5, "used_bytes": 2 * GIB,
          "reserved_bytes": 1536 * MIB, "peak_bytes": 1792 * MIB, "current_bytes": 1 * GIB, "block_bytes": 2 * MIB,
          "num_blocks": 100}


def _sample(db: Database, rank: int, step: int, ts: int, free: int) -> None:
    db.execute("INSERT INTO samples (run_id, rank, step, ts_ns, phase, allocated_bytes, peak_bytes, reserved_bytes,"
               " driver_used_bytes, driver_free_bytes, peak_is_step) VALUES ('r2', ?, ?, ?, 'serve', ?, ?, ?, ?, ?, 0)",
               (rank, step, ts, 1536 * MIB, 1536 * MIB, 1536 * MIB, 8 * GIB - free, free))


def _event(db: Database, rank: int, step: int, ts: int, kind: str, data: dict[str, object]) -> None:
    db.execute("INSERT INTO events (run_id, rank, step, ts_ns, kind, data) VALUES ('r2', ?, ?, ?, ?, ?)",
               (rank, step, ts, kind, json.dumps(data)))


@pytest.fixture
def db(tmp_path: Path) -> Database:
    db = open_store(tmp_path / "runs.db")
    db.execute(ENSURE_RUN, ("r2", "r2"))
    db.execute("UPDATE runs SET engine = 'vllm', started_ns = 50, ended_ns = 1000, status = 'oom', rank_count = 2"
               " WHERE run_id = 'r2'")
    for rank in (0, 1):
        db.execute("INSERT INTO ranks (run_id, rank, pid, gpu_name, status) VALUES ('r2', ?, ?, 'H100', ?)",
                   (rank, 40 + rank, "exited" if rank == 0 else "oom"))
        _event(db, rank, 0, 100, "kv_allocated", SIZING)
    _event(db, 0, 0, 90, "weights_loaded", {"weights_bytes": 900 * MIB})
    for step in (1, 2, 3):
        _sample(db, 0, step, 200 + step, 6 * GIB if step < 3 else 5 * GIB)
    for step in range(1, 8):
        _sample(db, 1, step, 300 + step, 3 * GIB)
    _event(db, 1, 7, 400, "oom", {"requested_bytes": 4 * GIB, "driver_free_bytes": 3 * GIB})
    db.conn.commit()
    return db


def test_the_run_figures_are_its_worst_ranks_and_name_it(db: Database) -> None:
    model = load_run(db, "r2")
    figures = model.figures
    zero, one = figures.ranks
    assert (zero.rank, zero.oom_step, zero.oom_margin_bytes) == (0, None, 5 * GIB - 768 * MIB)
    assert (one.rank, one.oom_step, one.oom_ts_ns, one.oom_margin_bytes) == (1, 7, 400, 0)
    assert (zero.weights_bytes, one.weights_bytes) == (900 * MIB, 1 * GIB)
    assert zero.kv_cache_bytes == one.kv_cache_bytes == 200 * MIB
    assert zero.non_torch_at_sizing_bytes == one.non_torch_at_sizing_bytes == 512 * MIB
    run = figures.to_dict()
    assert (run["worst_rank"], run["oom_step"], run["oom_margin_bytes"]) == (1, 7, 0)
    assert (run["weights_bytes"], run["kv_cache_bytes"], run["non_torch_at_sizing_bytes"]) == (
        900 * MIB + 1 * GIB, 400 * MIB, 1 * GIB)
    counted: dict[str, int] = {}
    for flag in model.flags:
        counted[flag.kind] = counted.get(flag.kind, 0) + 1
    assert run["flag_counts"] == dict(sorted(counted.items()))


def test_each_rank_carries_its_row_sizing_tail_and_figures(db: Database) -> None:
    model = load_run(db, "r2")
    assert [view.rank for view in model.ranks] == [0, 1]
    zero, one = model.ranks
    assert (zero.row["pid"], one.row["status"]) == (40, "oom")
    assert one.sizing is not None and (one.sizing.num_blocks, one.sizing.kv_bytes) == (100, 200 * MIB)
    assert [s.step for s in zero.tail] == [1, 2, 3] and [s.step for s in one.tail] == list(range(1, 8))
    assert zero.last is not None and zero.last.driver_free_bytes == 5 * GIB
    assert zero.total_bytes == one.total_bytes == 8 * GIB
    assert one.figures == model.figures.rank(1) and model.rank(1) is one and model.rank(5) is None
    assert not model.from_summaries  # no live summaries stored: replayed
    assert {rank: event.step for rank, event in model.first_ooms.items()} == {1: 7}
    assert [e.kind for e in model.ledger_events(0, 100)] == ["weights_loaded", "kv_allocated"]
    assert model.ledger_events(1, 99) == []


def test_windows_are_read_on_demand_and_bounded(db: Database) -> None:
    model = load_run(db, "r2")
    assert set(model.__dict__) == {"db", "run", "config"}  # loading read the run's row only
    assert [(s.rank, s.step) for s in model.samples(rank=1, since_ns=303, until_ns=305)] == [(1, 3), (1, 4), (1, 5)]
    assert [(s.rank, s.step) for s in model.samples(since_ns=203, until_ns=302)] == [(0, 3), (1, 1), (1, 2)]
    assert all(row.rollup is None for row in model.window())
    assert model.time_span() == (201, 307) and model.time_span(0) == (201, 203)
    assert model.sample_ranks == (0, 1)
    assert set(model.__dict__) >= {"run_key", "sample_ranks"} and "_detected" not in model.__dict__
    for step in range(8, 8 + WINDOW_STEPS):
        _sample(db, 1, step, 400 + step, 3 * GIB)
    db.conn.commit()
    tail = load_run(db, "r2").tails[1]
    assert len(tail) == WINDOW_STEPS and (tail[0].step, tail[-1].step) == (8, 7 + WINDOW_STEPS)


def test_the_model_cannot_be_changed(db: Database) -> None:
    model = load_run(db, "r2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.run = model.run  # type: ignore[misc]
    with pytest.raises(TypeError):
        model.summaries[0] = model.summaries[1]  # type: ignore[index]
    with pytest.raises(TypeError):
        model.rank_rows[0]["pid"] = 1  # type: ignore[index]
    assert isinstance(model.events, tuple) and isinstance(model.flags, tuple)


def test_runs_are_listed_newest_first_without_reading_them(db: Database) -> None:
    db.execute(ENSURE_RUN, ("r3", "r3"))
    db.execute("UPDATE runs SET started_ns = 60 WHERE run_id = 'r3'")
    models = load_runs(db)
    assert [m.run_id for m in models] == ["r3", "r2"]
    assert all(set(m.__dict__) == {"db", "run", "config"} for m in models)
    assert [m.run_id for m in load_runs(db, 1)] == ["r3"]


def test_what_the_model_reads_of_events_rows_and_rolled_seconds(db: Database) -> None:
    """cudagraph starts (the first per rank), preemptions counted (a count, else 1), a crashed rank's row, a CPU
    run's note, a rolled-up second at the head of a tail, and each rank's non-PyTorch drift.

    Drift, by hand: rank 0's non-PyTorch (used − reserved) is 0.5, 0.5, 1.5 GiB at steps 1, 2, 3: mean step 2,
    mean 5/6 GiB, Σ(dx·dy) = 1 GiB, Σdx² = 2, so 0.5 GiB a step; rank 1's is flat: 0."""
    _event(db, 0, 0, 130, "phase_start", {"phase": "cudagraph"})
    _event(db, 0, 0, 120, "phase_start", {"phase": "cudagraph"})
    _event(db, 1, 0, 110, "phase_start", {"phase": "compile"})
    _event(db, 1, 2, 302, "preemption", {"count": 3})
    _event(db, 1, 3, 303, "preemption", {})
    db.execute("UPDATE ranks SET status = 'crashed' WHERE rank = 1")
    [key] = db.execute("SELECT run_key FROM runs WHERE run_id = 'r2'").fetchone()
    db.execute("INSERT INTO sample_seconds (run_key, rank, second, samples, first_ts_ns, last_ts_ns, first_step,"
               " last_step, last_phase, last_driver_used_bytes, last_driver_free_bytes) VALUES (?, 0, 0, 5, 140, 150,"
               " 0, 0, 'serve', ?, ?)", (key, 1 * GIB, 7 * GIB))
    db.conn.commit()
    model = load_run(db, "r2")
    assert dict(model.capture_ns) == {0: 120}
    assert model.preemptions == ((1, 4),)
    assert model.dead_ranks == frozenset({1})
    assert model.device_note is None
    assert [(s.step, s.ts_ns) for s in model.tails[0]] == [(0, 150), (1, 201), (2, 202), (3, 203)]
    rows = list(model.window(rank=0))
    assert [row.rollup is not None for row in rows] == [True, False, False, False]
    assert rows[0].rollup is not None and (rows[0].rollup.samples, rows[0].rollup.first_ts_ns) == (5, 140)
    assert model.time_span(0) == (140, 203)
    assert model.drift_slope(0) == 0.5 * GIB and model.drift_slope(1) == 0
    assert model.drift_slope(7) is None  # no samples: no slope
    assert [e.kind for e in model.rank_events(1)] == ["kv_allocated", "phase_start", "preemption", "preemption", "oom"]
    assert [e.ts_ns for e in model.rank_events(1, ("preemption",), until_ns=302)] == [302]
    db.execute("UPDATE ranks SET gpu_name = 'CPU', probe_unavailable = 'no CUDA device' WHERE rank = 0")
    db.conn.commit()
    assert load_run(db, "r2").device_note == "no CUDA device"


def test_a_run_without_samples_reads_empty(db: Database) -> None:
    db.execute(ENSURE_RUN, ("bare", "bare"))
    db.conn.commit()
    model = load_run(db, "bare")
    assert model.ranks == () and model.tails == {} and model.sample_ranks == () and list(model.window()) == []
    assert model.figures.to_dict()["worst_rank"] is None and model.time_span() == (None, None)


def test_drift_needs_two_serving_samples_at_two_steps_and_windows_keep_to_their_rank(db: Database) -> None:
    """Rank 2: non-PyTorch 1 GiB at step 4 and 2 GiB at step 6, so 0.5 GiB a step from two samples; rank 3: two
    samples at one step give no slope (no spread of steps to divide by); rank 4: one sample gives none."""
    for rank, step, free in ((2, 4, 5632 * MIB), (2, 6, 4608 * MIB), (3, 5, 4 * GIB), (3, 5, 3 * GIB),
                             (4, 1, 4 * GIB)):
        db.execute("INSERT INTO samples (run_id, rank, step, ts_ns, phase, allocated_bytes, reserved_bytes,"
                   " driver_used_bytes, driver_free_bytes) VALUES ('r2', ?, ?, ?, 'serve', ?, ?, ?, ?)",
                   (rank, step, 500 + step + free // MIB, 1536 * MIB, 1536 * MIB, 8 * GIB - free, free))
    db.conn.commit()
    model = load_run(db, "r2")
    assert model.drift_slope(2) == 0.5 * GIB
    assert model.drift_slope(3) is None and model.drift_slope(4) is None
    assert [(s.rank, s.step) for s in model.samples(rank=0)] == [(0, 1), (0, 2), (0, 3)]
    assert [e.kind for e in model.ledger_events(1, 400)] == ["kv_allocated"]  # the oom changes no ledger term
    listed = {m.run_id: m for m in load_runs(db)}
    assert listed["r2"].figures.to_dict() == model.figures.to_dict()


def test_the_device_size_needs_both_driver_readings(db: Database) -> None:
    from memwatch.store.run_model import device_total

    [sample] = load_run(db, "r2").samples(rank=0, until_ns=201)
    assert device_total(sample) == 8 * GIB and device_total(None) is None
    assert device_total(sample._replace(driver_used_bytes=None)) is None
    assert device_total(sample._replace(driver_free_bytes=None)) is None
