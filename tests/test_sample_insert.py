"""A drain's samples are stored through a statement fitted to the drain; the rows are those the full one stores."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from memwatch.sidecar.collector import Collector
from memwatch.sidecar.ring_state import MAX_SHAPES, RingState
from memwatch.store import open_store
from memwatch.store.sample_insert import NULLABLE_FIELDS, nullable_fields, raw_sample_insert, single_phase
from memwatch.store.writer import StoreWriter
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_format import _CHUNK, _SAMPLE_SLOT, TYPE_EVENT, TYPE_SAMPLE
from memwatch_engine.ring_reader import RingReader

from processes import query

NAMES = {1: "load", 5: "serve", 16: "custom"}
FULL = (0, TYPE_SAMPLE, 1, 5, 2, 7, 10**18, 14 << 30, 18 << 30, 15 << 30, 20 << 30, 60 << 30, 64, 400, 3780, 64,
        60, 14 << 30, 32 << 20, 0, 0)
"""A version 2 sample with every reading, as ``RingReader.drain`` returns it."""


COLUMNS = ("run_key, rank, step, ts_ns, phase, allocated_bytes, peak_bytes, reserved_bytes, driver_used_bytes,"
           " driver_free_bytes, kv_blocks_used, kv_blocks_total, num_seqs, num_tokens, step_kind, peak_is_step,"
           " process_used_bytes, segments, active_bytes, inactive_split_bytes, alloc_retries, num_ooms, seq")
"""The columns of ``sample_rows`` the statements name, in a bare table of their own."""


def _slots(rows: list[tuple[int, ...]]) -> bytes:
    return b"".join(_SAMPLE_SLOT.pack(*row) for row in rows)


def test_a_drain_with_every_reading_binds_every_column_as_it_is() -> None:
    slots = _slots([FULL, FULL])
    assert nullable_fields(slots) == frozenset()
    assert single_phase(slots) == 5
    sql = raw_sample_insert("r", 0, NAMES, 2, 1, nullable=nullable_fields(slots), phase=single_phase(slots))
    assert "NULLIF" not in sql and "CASE ?4" not in sql and "'serve'" in sql


def test_each_field_that_holds_minus_one_somewhere_keeps_its_nullif() -> None:
    for at in NULLABLE_FIELDS:
        missing = list(FULL)
        missing[at] = -1
        assert nullable_fields(_slots([FULL, tuple(missing), FULL])) == {at}, at
    assert nullable_fields(b"") == frozenset(NULLABLE_FIELDS)  # nothing to look at: the full statement


def test_an_event_slot_may_keep_a_nullif_or_a_case_but_never_drops_one() -> None:
    def chunk(length: int) -> bytes:
        return _CHUNK.pack(1, TYPE_EVENT, 0, length, 7, 10**18, b"\xff" * 96)

    assert len(chunk(96)) == len(_slots([FULL]))
    # The chunk's length byte sits where a sample's phase does: another value keeps the CASE; the same value
    # gives the samples' phase, which is every sample's.
    assert single_phase(_slots([FULL]) + chunk(96)) is None
    assert single_phase(_slots([FULL]) + chunk(5)) == 5
    assert nullable_fields(_slots([FULL]) + chunk(96)) <= frozenset(NULLABLE_FIELDS)
    assert single_phase(_slots([FULL, (*FULL[:3], 1, *FULL[4:])])) is None  # two phases: CASE


def _stored(rows: list[tuple[int, ...]], sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute(f"CREATE TABLE sample_rows ({COLUMNS})")
        conn.executemany(sql, rows)
        return conn.execute("SELECT * FROM sample_rows ORDER BY seq").fetchall()
    finally:
        conn.close()


def test_fitted_statements_store_exactly_what_the_full_one_stores_on_random_drains() -> None:
    rng = random.Random(25)
    full_sql = raw_sample_insert("r", 3, NAMES, 2, 9)
    for _ in range(300):
        rows = []
        phase = rng.choice([1, 5, 16, 99])  # 99: a code the ring never named (stored as NULL)
        for seq in range(rng.randint(1, 12)):
            row = list(FULL)
            row[0], row[3] = seq, phase if rng.random() < 0.8 else rng.choice([1, 5, 16, 99])
            row[4] = rng.choice([0, 1, 2])
            for at in NULLABLE_FIELDS:
                roll = rng.random()
                if roll < 0.15:
                    row[at] = -1
                elif roll < 0.2:  # a hostile writer's other negatives are stored as they are
                    row[at] = -rng.randint(2, 1 << 31)
                elif roll < 0.25:
                    row[at] = 0
            rows.append(tuple(row))
        slots = _slots(rows)
        fitted = raw_sample_insert("r", 3, NAMES, 2, 9, nullable=nullable_fields(slots), phase=single_phase(slots))
        assert _stored(rows, fitted) == _stored(rows, full_sql)


def test_missing_readings_are_stored_as_null_through_the_collector(runtime_dir: Path, db_path: Path) -> None:
    ring = RingWriter(runtime_dir / "gaps-r0.ring", run_id="gaps", meta={}, capacity=1024)
    for step in range(40):  # every reading in the first 20 steps; from then on no driver reading
        used, free = (20, 60) if step < 20 else (-1, -1)
        ring.write_sample(step, 10**18 + step, 5, 2, 0, 10, 12, 14, used, free, 64, 400, 3780, 8, 3, 9, 1, 0, 0)
    ring.close()
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: False)
    try:
        collector.scan()
        for _ in range(3):
            collector.poll()
        assert writer.flush(timeout=30)
    finally:
        writer.close()
        collector.close()
    assert query(db_path, "SELECT count(*), count(driver_used_bytes), count(driver_free_bytes), count(allocated_bytes),"
                          " min(phase), max(phase) FROM samples") == [(40, 20, 20, 40, "serve", "serve")]


def test_a_ring_whose_drains_change_shape_every_time_keeps_a_bounded_set_of_statements(runtime_dir: Path) -> None:
    path = runtime_dir / "shapes-r0.ring"
    RingWriter(path, run_id="shapes", meta={}, capacity=1024).close()
    reader = RingReader(path)
    try:
        state = RingState(path, "shapes/0/0", reader, 0, 0)
        made = set()
        for at in NULLABLE_FIELDS:  # 14 shapes with one field missing, then 14 with two
            for other in (None, 7 if at != 7 else 8):
                row = list(FULL)
                row[at] = -1
                if other is not None:
                    row[other] = -1
                made.add(state.sample_insert(_slots([tuple(row)])))
                assert len(state._statements) <= MAX_SHAPES
        assert len(made) == 2 * len(NULLABLE_FIELDS) - 1  # every shape got its own statement (7+8 twice)
    finally:
        reader.close()
