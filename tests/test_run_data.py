"""What the report draws of a stored run, on a small run written row by row: every point derived by hand.

Rank 0 loads 4 GiB of weights (t = 15) and sizes a 1 GiB KV cache at t = 40 with 4.5 GiB allocated (0.5 GiB of
other long-lived PyTorch, and 0.5 GiB more its graph capture declares at t = 45); it serves from t = 50 and runs out
of memory at t = 90. Rank 1 reads little (no allocator reserve, then nothing, then the driver alone) and sizes only
after its last sample, the run's last (t = 248); rank 2 sizes at t = 150 with nothing but its weights allocated and
has no ``ranks`` row; rank -1 (the host's own samples) is not drawn. Every stacked point sums to the driver's used
memory where the driver was read.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from memwatch.report.facts import rank_facts
from memwatch.report.run_data import Phase, RunData, load_run_data, run_data_of
from memwatch.store import open_store
from memwatch.store.db import Database
from memwatch.store.run_model import load_run
from memwatch.store.schema import ENSURE_RUN, migrate

GiB = 1 << 30
MiB = 1 << 20
SIZING = {"total_bytes": 16 * GiB, "gpu_memory_utilization": 0.5, "used_bytes": 6 * GiB,
          "reserved_bytes": 4 * GiB + GiB // 2, "peak_bytes": 5 * GiB, "current_bytes": 4 * GiB + GiB // 2,
          "block_bytes": MiB, "num_blocks": 1024}
HALF = GiB // 2
QUARTER = GiB // 4


def _sample(db: Database, rank: int, step: int, ts: int, phase: str | None, allocated: int | None,
            reserved: int | None, used: int | None, kv: tuple[int | None, int | None] = (None, None),
            run: str = "rd") -> None:
    db.execute("INSERT INTO samples (run_id, rank, step, ts_ns, phase, allocated_bytes, peak_bytes, reserved_bytes,"
               " driver_used_bytes, driver_free_bytes, kv_blocks_used, kv_blocks_total, peak_is_step)"
               " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
               (run, rank, step, ts, phase, allocated, allocated, reserved, used,
                None if used is None else 16 * GiB - used, *kv))


def _event(db: Database, rank: int, ts: int, kind: str, data: dict[str, object]) -> None:
    db.execute("INSERT INTO events (run_id, rank, step, ts_ns, kind, data) VALUES ('rd', ?, 0, ?, ?, ?)",
               (rank, ts, kind, json.dumps(data)))


@pytest.fixture
def db(tmp_path: Path) -> Database:
    db = open_store(tmp_path / "runs.db")
    db.execute(ENSURE_RUN, ("rd", "rd"))
    db.execute("UPDATE runs SET engine = 'vllm', started_ns = 5, ended_ns = 500, status = 'oom', rank_count = 3,"
               " gpu_total_bytes = 24 * 1073741824 WHERE run_id = 'rd'")
    for rank, status in ((0, "oom"), (1, "exited")):
        db.execute("INSERT INTO ranks (run_id, rank, pid, gpu_name, status) VALUES ('rd', ?, 1, 'H100', ?)",
                   (rank, status))
    for ts, kind, data in ((10, "phase_start", {"phase": "load"}), (15, "weights_loaded", {"weights_bytes": 4 * GiB}),
                           (30, "phase_end", {"phase": "load"}), (40, "kv_allocated", SIZING),
                           (45, "phase_end", {"phase": "cudagraph", "long_lived_bytes": HALF}),
                           (50, "phase_start", {"phase": "serve"}),
                           (70, "preemption", {"count": 2}), (75, "snapshot_segments", {}),
                           (90, "oom", {"requested_bytes": GiB})):
        _event(db, 0, ts, kind, data)
    _sample(db, 0, 0, 15, "load", 2 * GiB, 2 * GiB, 3 * GiB)
    _sample(db, 0, 1, 60, "serve", 6 * GiB, 6 * GiB + HALF, 7 * GiB + HALF, (100, 1024))
    _sample(db, 0, 2, 80, "serve", 5 * GiB + 3 * QUARTER, 6 * GiB + HALF, 8 * GiB, (200, 1024))
    _sample(db, 0, 3, 85, "serve", 4 * GiB + QUARTER, 6 * GiB + HALF, 8 * GiB, (300, 1024))
    _sample(db, 1, 0, 230, "serve", GiB, None, None)
    _sample(db, 1, 1, 240, "serve", GiB + HALF, None, None)
    _sample(db, 1, 2, 245, "serve", None, None, None)
    _sample(db, 1, 3, 248, "serve", None, None, 2 * GiB)
    _event(db, 1, 250, "kv_allocated", {**SIZING, "total_bytes": None})
    _event(db, 2, 150, "kv_allocated", {**SIZING, "current_bytes": 2 * GiB, "peak_bytes": 2 * GiB + HALF,
                                        "used_bytes": 3 * GiB, "reserved_bytes": 2 * GiB})
    _sample(db, 2, 0, 200, None, None, GiB, 2 * GiB)
    _sample(db, 2, 1, 210, None, 3 * GiB, 3 * GiB + HALF, 4 * GiB)
    _sample(db, 2, 2, 220, None, 2 * GiB + HALF, 3 * GiB + HALF, 4 * GiB)
    _sample(db, -1, 0, 300, None, None, None, 5 * GiB)
    db.conn.commit()
    return db


def test_each_ranks_points_stack_the_ledgers_terms_up_to_the_drivers_used(db: Database) -> None:
    data = load_run_data(db, "rd")
    # from rank 0's first sample to rank 1's last, though rank 2 is drawn after it
    assert (data.run.run_id, data.start_ns, data.end_ns, [rank.rank for rank in data.ranks]) == ("rd", 15, 248,
                                                                                                [0, 1, 2])
    assert data.model is not None and data.model.run_id == "rd"
    points = data.ranks[0].points
    assert (points.ts_ns, points.step, points.used) == ([15, 60, 80, 85], [0, 1, 2, 3],
                                                        [3 * GiB, 7 * GiB + HALF, 8 * GiB, 8 * GiB])
    # Loading, the weights (loaded at that very moment) are all that is allocated. Serving, other long-lived PyTorch
    # is what stays allocated beyond weights and KV (1 GiB), never below the 1 GiB sizing and the capture left, nor
    # above what is allocated beyond the weights (0.25 GiB at t = 85); the KV cache takes what is left of it.
    assert points.stack == {
        "weights": [2 * GiB, 4 * GiB, 4 * GiB, 4 * GiB], "torch_other": [0, GiB, GiB, QUARTER],
        "kv": [0, GiB, 3 * QUARTER, 0], "activations": [0, 0, 0, 0],
        "cache_slack": [0, HALF, 3 * QUARTER, 2 * GiB + QUARTER], "non_torch": [GiB, GiB, GiB + HALF, GiB + HALF]}
    assert [sum(column[i] for column in points.stack.values()) for i in range(4)] == points.used
    assert (points.budget, points.kv_used, points.kv_total) == ([None, 8 * GiB, 8 * GiB, 8 * GiB],
                                                                [None, 100, 200, 300], [None, 1024, 1024, 1024])
    # Unsized, what is allocated is activations; with nothing read, nothing is drawn; the driver alone is non-PyTorch.
    one = data.ranks[1].points
    assert (one.used, one.budget) == ([None, None, None, 2 * GiB], [None] * 4)
    assert {key: values for key, values in one.stack.items() if any(values)} == {
        "activations": [GiB, GiB + HALF, 0, 0], "non_torch": [0, 0, 0, 2 * GiB]}
    # Sized with its weights alone allocated (no other long-lived PyTorch): exactly weights and KV allocated leaves
    # no other; less than that is less KV.
    two = data.ranks[2].points
    assert two.stack == {"weights": [0, 2 * GiB, 2 * GiB], "torch_other": [0, 0, 0], "kv": [0, GiB, HALF],
                         "activations": [0, 0, 0], "cache_slack": [GiB, HALF, GiB], "non_torch": [GiB, HALF, HALF]}
    assert (two.used, two.budget) == ([2 * GiB, 4 * GiB, 4 * GiB], [8 * GiB] * 3)


def test_each_rank_carries_its_phases_events_sizing_and_device(db: Database) -> None:
    zero, one, two = load_run_data(db, "rd").ranks
    # The serve phase never ended: it lasts to the rank's last sample; a phase that never started is not drawn.
    assert zero.phases == [Phase("load", 10, 30), Phase("serve", 50, 85)]
    assert (zero.status, [e.ts_ns for e in zero.ooms], [e.data for e in zero.preemptions],
            [e.kind for e in zero.snapshot]) == ("oom", [90], [{"count": 2}], ["snapshot_segments"])
    assert (zero.weights_bytes, zero.sizing["num_blocks"], zero.sizing["current_bytes"], zero.total_bytes) == (
        4 * GiB, 1024, 4 * GiB + HALF, 16 * GiB)
    assert zero.has_kv and not one.has_kv and not two.has_kv
    # Sized after its last sample, still sized; its device's size is the run's when the sizing lacks it.
    assert (one.status, one.phases, one.weights_bytes, one.sizing["num_blocks"], one.total_bytes) == (
        "exited", [], None, 1024, 24 * GiB)
    assert (two.status, two.sizing["current_bytes"], two.total_bytes, two.ooms, two.preemptions) == (
        None, 2 * GiB, 16 * GiB, [], [])
    model = load_run(db, "rd")
    for rank in (zero, one, two):
        assert rank.flags == [flag for flag in model.flags if flag.rank == rank.rank]
        assert rank.cuda_graphs_outside_budget_bytes is None  # vLLM counts its graphs in its budget
    assert zero.series.samples == 4 and two.series.samples == 3


def test_a_long_rank_is_drawn_as_each_buckets_low_then_its_high(db: Database) -> None:
    zero, one, two = load_run_data(db, "rd", buckets=1).ranks
    assert zero.series.downsampled and len(one.points.ts_ns) == len(two.points.ts_ns) == 2
    points = zero.points
    assert (points.ts_ns, points.used) == ([15, 85], [3 * GiB, 8 * GiB])
    assert points.step == [0, 3] and points.kv_used == [100, 300] and points.kv_total == [1024, 1024]
    # The high side holds every event up to its end: weights, KV and 1 GiB kept beyond them (6 GiB allocated).
    assert [points.stack[key][1] for key in ("weights", "torch_other", "kv", "cache_slack", "non_torch")] == [
        4 * GiB, GiB, GiB, HALF, GiB + HALF]


def test_a_run_without_samples_spans_its_recorded_times(db: Database) -> None:
    db.execute(ENSURE_RUN, ("quiet", "quiet"))
    db.execute("UPDATE runs SET started_ns = 7, ended_ns = 70 WHERE run_id = 'quiet'")
    db.execute("INSERT INTO ranks (run_id, rank, status) VALUES ('quiet', 0, 'exited')")
    db.execute("INSERT INTO events (run_id, rank, step, ts_ns, kind, data) VALUES ('quiet', 0, 0, 9, 'phase_start',"
               " '{\"phase\": \"load\"}'), ('quiet', 0, 0, 12, 'phase_start', '{}')")
    db.conn.commit()
    data = run_data_of(load_run(db, "quiet"))
    assert isinstance(data, RunData) and (data.start_ns, data.end_ns) == (7, 70)
    [rank] = data.ranks
    assert (rank.status, rank.phases, rank.series.samples, rank.points.ts_ns) == ("exited", [Phase("load", 9, 70),
                                                                                              Phase("?", 12, 70)],
                                                                                  0, [])
    db.execute("UPDATE runs SET started_ns = NULL, ended_ns = NULL WHERE run_id = 'quiet'")
    db.conn.commit()
    bare = run_data_of(load_run(db, "quiet"))
    assert (bare.start_ns, bare.end_ns) == (0, 0)


def test_nano_vllms_graphs_captured_after_sizing_are_said_on_their_rank(db: Database) -> None:
    # Captured at t = 45, after the sizing: the first serving sample's 6 GiB less 4.5 GiB current and 1 GiB of KV
    # is 0.5 GiB of graphs, and the last sample keeps exactly that beyond the 1 GiB other after the capture.
    db.execute("UPDATE runs SET engine = 'nano-vllm' WHERE run_id = 'rd'")
    _event(db, 0, 45, "phase_start", {"phase": "cudagraph"})
    _sample(db, 0, 4, 95, "serve", 6 * GiB + HALF, 7 * GiB, 8 * GiB + HALF)
    db.conn.commit()
    ranks = load_run_data(db, "rd").ranks
    assert [rank.cuda_graphs_outside_budget_bytes for rank in ranks] == [HALF, None, None]
    # drawn as other long-lived PyTorch: 6.5 GiB allocated less 4 GiB of weights and 1 GiB of KV
    assert ranks[0].points.stack["torch_other"][-1] == GiB + HALF


def test_ranks_are_those_with_a_row_or_samples(db: Database) -> None:
    db.execute("DELETE FROM ranks WHERE run_id = 'rd' AND rank = 0")
    db.conn.commit()
    data = load_run_data(db, "rd")
    assert [(rank.rank, rank.status, rank.series.samples) for rank in data.ranks] == [(0, None, 4), (1, "exited", 4),
                                                                                      (2, None, 3)]


def test_one_rank_or_a_store_in_memory_is_read_on_its_own_connection(db: Database) -> None:
    db.execute(ENSURE_RUN, ("solo", "solo"))
    _sample(db, 3, 7, 1_000, "serve", GiB, GiB + HALF, 2 * GiB, run="solo")
    _sample(db, 3, 8, 1_010, "serve", GiB + HALF, 2 * GiB, 3 * GiB, run="solo")
    _sample(db, 3, 9, 1_020, "serve", GiB + HALF, 2 * GiB, 5 * GiB // 2, run="solo")
    db.conn.commit()
    # three samples in one bucket: its low, then its high
    [solo] = load_run_data(db, "solo", buckets=1).ranks
    assert (solo.rank, solo.series.samples, solo.points.ts_ns, solo.points.used) == (3, 3, [1_000, 1_020],
                                                                                     [2 * GiB, 3 * GiB])
    memory = Database(sqlite3.connect(":memory:"))  # no file to open a second connection on
    migrate(memory)
    memory.execute(ENSURE_RUN, ("mem", "mem"))
    for rank in (0, 1):
        _sample(memory, rank, 0, 5 + rank, "serve", GiB, GiB, (2 + rank) * GiB, run="mem")
    memory.conn.commit()
    assert [rank.points.used for rank in load_run_data(memory, "mem").ranks] == [[2 * GiB], [3 * GiB]]


def test_the_serving_peak_is_read_from_the_stored_samples_however_few_the_buckets(tmp_path: Path) -> None:
    """300 samples a nanosecond apart: warm-up peaks at 9 GiB, the first serving sample (t = 150) at 8 GiB, the
    rest 5 GiB. At 50 buckets one bucket spans t = 144..149 and the next begins the serve phase; whichever bucket
    holds t = 150, the serving peak is 8 GiB, never warm-up's 9 GiB nor the later 5 GiB."""
    db = open_store(tmp_path / "peak.db")
    db.execute(ENSURE_RUN, ("pk", "pk"))
    db.execute("UPDATE runs SET started_ns = 0, ended_ns = 400, status = 'ok', rank_count = 1 WHERE run_id = 'pk'")
    db.execute("INSERT INTO events (run_id, rank, step, ts_ns, kind, data) VALUES ('pk', 0, 0, 150, 'phase_start',"
               " '{\"phase\": \"serve\"}')")
    for ts in range(1, 301):
        peak = 9 * GiB if ts < 150 else 8 * GiB if ts == 150 else 5 * GiB
        db.execute("INSERT INTO samples (run_id, rank, step, ts_ns, allocated_bytes, peak_bytes) VALUES"
                   " ('pk', 0, ?, ?, ?, ?)", (ts, ts, GiB, peak))
    db.conn.commit()
    for buckets in (50, 1500):
        [rank] = run_data_of(load_run(db, "pk"), buckets=buckets).ranks
        assert rank.series.downsampled is (buckets == 50)
        assert rank.serving_peak_bytes == rank_facts(rank).serving_peak_bytes == 8 * GiB
