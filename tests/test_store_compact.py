"""Compact sample storage: the integer run key, the ``samples`` view, and the migration of older files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from memwatch.records import SAMPLE_COLUMNS
from memwatch.store import open_store
from memwatch.store.db import Database
from memwatch.store.schema import MIGRATIONS, SCHEMA_VERSION
from memwatch.store.window import downsampled, time_span, window_rows


def _version_1(path: Path) -> None:
    """A database as the previous memwatch wrote it: schema version 1, text run ids in every sample."""
    db = Database(sqlite3.connect(path))
    MIGRATIONS[0](db)
    db.execute("PRAGMA user_version = 1")
    conn = db.conn
    with conn:
        conn.execute("INSERT INTO runs (run_id, started_ns, status) VALUES ('old-a', 1, 'ok'), ('old-b', 2, 'oom')")
        conn.executemany(
            "INSERT INTO samples VALUES (?, ?, ?, ?, 'serve', ?, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
            " 'decode', 1, NULL)",
            [(run, rank, step, 1000 + step, step * 10) for run in ("old-a", "old-b", "orphan") for rank in (0, 1)
             for step in range(5)],
        )
        conn.execute("INSERT INTO flags VALUES ('old-b', 1, 3, 1003, 'oom', 'critical', 'm', '{}')")
    conn.close()


def test_migration_keeps_every_sample_under_an_integer_key(db_path: Path) -> None:
    _version_1(db_path)
    db = open_store(db_path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == len(MIGRATIONS)
    keys = dict(db.execute("SELECT run_id, run_key FROM runs").fetchall())
    assert set(keys) == {"old-a", "old-b", "orphan"}  # samples without a runs row got one
    assert sorted(keys.values()) == [1, 2, 3]
    # 3 runs x 2 ranks x 5 steps, all still readable by run id through the view, in their columns
    assert db.execute("SELECT count(*) FROM sample_rows").fetchone()[0] == 30
    rows = db.execute(f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM samples WHERE run_id = 'old-b' AND rank = 1"
                      " ORDER BY ts_ns").fetchall()
    assert [row[2] for row in rows] == [0, 1, 2, 3, 4] and rows[4][5] == 40 and rows[4][14] == "decode"
    assert "run_id" not in [c[1] for c in db.execute("PRAGMA table_info(sample_rows)")]
    assert db.execute("SELECT count(*) FROM flags").fetchone()[0] == 1


def test_inserts_through_the_view_get_a_key_and_new_runs_get_the_next_key(db_path: Path) -> None:
    db = open_store(db_path)
    with db.conn:
        db.execute("INSERT INTO runs (run_id, started_ns) VALUES ('r1', 5)")
        db.execute("INSERT INTO samples (run_id, rank, step, ts_ns) VALUES ('r1', 0, 7, 100)")
        db.execute("INSERT INTO samples (run_id, rank, step, ts_ns) VALUES ('unregistered', 2, 1, 50)")
    assert db.execute("SELECT run_id, run_key FROM runs ORDER BY run_key").fetchall() == [("r1", 1),
                                                                                           ("unregistered", 2)]
    assert db.execute("SELECT run_key, rank, step FROM sample_rows ORDER BY run_key").fetchall() == [(1, 0, 7),
                                                                                                      (2, 2, 1)]


def test_window_reads_full_and_rolled_up_rows_in_time_order(db_path: Path) -> None:
    db = open_store(db_path)
    s = 1_000_000_000
    with db.conn:
        db.execute("INSERT INTO runs (run_id, started_ns) VALUES ('w', 0)")
        db.conn.executemany("INSERT INTO samples (run_id, rank, step, ts_ns, allocated_bytes) VALUES ('w', 0, ?, ?, ?)",
                            [(step, 10 * s + step, 100 + step) for step in range(3)])
        # second 4 of rank 0 rolled up: 50 samples, allocated 7..90, last 60 at step 49
        db.execute("INSERT INTO sample_seconds (run_key, rank, second, samples, first_ts_ns, last_ts_ns, first_step,"
                   " last_step, min_allocated_bytes, max_allocated_bytes, last_allocated_bytes)"
                   " VALUES (1, 0, 4, 50, ?, ?, 0, 49, 7, 90, 60)", (4 * s, 4 * s + 900))
    rows = list(window_rows(db, "w"))
    assert [row.sample.ts_ns for row in rows] == [4 * s + 900, 10 * s, 10 * s + 1, 10 * s + 2]
    first = rows[0]
    assert first.sample.step == 49 and first.sample.allocated_bytes == 60 and first.rollup is not None
    assert (first.rollup.samples, first.rollup.minimum["allocated_bytes"], first.rollup.maximum["allocated_bytes"]) \
        == (50, 7, 90)
    assert all(row.rollup is None for row in rows[1:])
    assert [r.sample.step for r in window_rows(db, "w", since_ns=10 * s + 1, until_ns=10 * s + 2)] == [1, 2]
    assert time_span(db, "w") == (4 * s, 10 * s + 2)
    # two buckets: the rolled second keeps its min and max, the full-resolution second its own
    buckets = downsampled(db, "w", 0, buckets=2, columns=("allocated_bytes",))
    assert [(b.samples, b.minimum["allocated_bytes"], b.maximum["allocated_bytes"]) for b in buckets] == [
        (50, 7, 90), (3, 100, 102)]
