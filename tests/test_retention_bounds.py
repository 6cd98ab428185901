"""The store's bounds: per-second rows kept for a window, and a cap on the pages in use, with real SQLite.

Without them a long run's per-second rows grew for ever (0.3 GB a day for 8 ranks) until a volume's limit
evicted the pod. The evidence (full-resolution rows around flags and OOMs), the flags, events and summaries
stay; the cap drops other runs' samples oldest first and never a live run's full-resolution rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memwatch.errors import UsageError
from memwatch.store import open_store
from memwatch.store.db import Database
from memwatch.store.retention import Retention, apply_retention, used_bytes

S = 1_000_000_000
STEP_NS = 10_000_000  # 100 steps/s


def _run(db: Database, run_id: str, seconds: int, status: str, started_s: int = 0, ranks: int = 2) -> int:
    """A run of ``ranks`` ranks at 100 steps/s for ``seconds``, its rows made by SQLite; returns its key."""
    with db.conn:
        db.execute("INSERT INTO runs (run_id, started_ns, status) VALUES (?, ?, ?)", (run_id, started_s * S, status))
        db.conn.executemany("INSERT INTO ranks (run_id, rank) VALUES (?, ?)", [(run_id, r) for r in range(ranks)])
        key = db.execute("SELECT run_key FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0]
        db.execute("WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c WHERE i < ?)"
                   " INSERT INTO sample_rows (run_key, rank, step, ts_ns, phase, allocated_bytes, reserved_bytes,"
                   " driver_used_bytes, seq) SELECT ?, r.value, i, ? + i * ? + r.value, 'serve', 1000 + i % 97,"
                   " 5000 + i % 13, 9000 + i, i FROM c, json_each(?) r",
                   (seconds * 100 - 1, key, started_s * S, STEP_NS, str(list(range(ranks)))))
    return key


def _count(db: Database, sql: str, *params: object) -> int:
    return db.execute(sql, params).fetchone()[0]


def test_a_run_longer_than_the_rollup_window_keeps_only_the_window(tmp_path: Path) -> None:
    db = open_store(tmp_path / "m.db")
    key = _run(db, "long", 600, "running")
    with db.conn:  # a flag at 30 s: far older than the roll-up window, its evidence stays whole
        db.execute("INSERT INTO flags (run_id, rank, step, ts_ns, kind, severity, message, data) VALUES"
                   " ('long', 0, 3000, ?, 'fragmentation', 'warning', 'm', '{}')", (30 * S,))
    apply_retention(db, Retention(full_ns=60 * S, evidence_ns=5 * S, rollups_ns=120 * S))
    # newest sample 599.99 s: full resolution from second 539, per-second rows for [479, 539), evidence 25..35 s
    for rank in (0, 1):
        seconds = db.execute("SELECT min(second), max(second), count(*), sum(samples) FROM sample_seconds"
                             " WHERE run_key = ? AND rank = ?", (key, rank)).fetchone()
        assert seconds == (479, 538, 60, 6000)
        assert _count(db, "SELECT count(*) FROM sample_rows WHERE run_key = ? AND rank = ? AND ts_ns >= ?",
                      key, rank, 539 * S) == 6100
        assert _count(db, "SELECT count(*) FROM sample_rows WHERE run_key = ? AND rank = ? AND ts_ns < ?",
                      key, rank, 539 * S) == 1100  # the flag's seconds 25..35, every sample
    assert _count(db, "SELECT count(*) FROM flags WHERE run_id = 'long'") == 1
    # a second pass changes nothing: the window is a bound, not a drift
    before = _count(db, "SELECT count(*) FROM sample_seconds")
    apply_retention(db, Retention(full_ns=60 * S, evidence_ns=5 * S, rollups_ns=120 * S))
    assert _count(db, "SELECT count(*) FROM sample_seconds") == before


def test_forever_keeps_every_per_second_row(tmp_path: Path) -> None:
    db = open_store(tmp_path / "m.db")
    key = _run(db, "long", 300, "running", ranks=1)
    apply_retention(db, Retention(full_ns=60 * S, evidence_ns=5 * S, rollups_ns=None))
    assert _count(db, "SELECT count(*) FROM sample_seconds WHERE run_key = ?", key) == 239  # seconds 0..238
    with pytest.raises(UsageError):
        Retention(rollups_ns=0)


def test_the_size_cap_drops_the_oldest_runs_samples_first_and_holds(tmp_path: Path) -> None:
    db = open_store(tmp_path / "m.db")
    sizes = []
    for i, run_id in enumerate(("old", "middle", "recent")):
        before = used_bytes(db)
        _run(db, run_id, 120, "ended", started_s=i * 1000)
        sizes.append(used_bytes(db) - before)
    _run(db, "live", 120, "running", started_s=5000)
    with db.conn:
        db.execute("INSERT INTO flags (run_id, rank, step, ts_ns, kind, severity, message, data) VALUES"
                   " ('old', 0, 10, 0, 'oom_risk', 'warning', 'm', '{}')")
    total = used_bytes(db)
    cap = total - sizes[0] - sizes[1] // 4  # over by the oldest run and a quarter of the next
    apply_retention(db, Retention(full_ns=3600 * S, evidence_ns=5 * S, max_db_bytes=cap))
    assert used_bytes(db) <= cap
    rows = dict(db.execute("SELECT r.run_id, count(s.rank) FROM runs r LEFT JOIN sample_rows s ON s.run_key ="
                           " r.run_key GROUP BY r.run_id").fetchall())
    assert rows["old"] == 0  # the oldest went first, whole
    assert rows["middle"] == 12000  # one rank at a time: a quarter of it over the cap took one of its two ranks
    assert rows["recent"] == 24000 and rows["live"] == 24000  # the newest and the live run untouched
    # the runs themselves, their ranks and flags stay: `memwatch runs` and `check` still see them
    assert _count(db, "SELECT count(*) FROM runs") == 4
    assert _count(db, "SELECT count(*) FROM flags WHERE run_id = 'old'") == 1


def test_over_the_cap_a_live_run_keeps_its_tail_and_its_last_evidence_and_nothing_else(tmp_path: Path) -> None:
    db = open_store(tmp_path / "m.db")
    key = _run(db, "live", 900, "running", ranks=1)
    with db.conn:  # three flags behind the full-resolution tail (from 599 s), each with 5 s of evidence either side
        db.conn.executemany("INSERT INTO flags (run_id, rank, step, ts_ns, kind, severity, message, data) VALUES"
                            " ('live', 0, ?, ?, 'fragmentation', 'warning', 'm', '{}')",
                            [(t * 100, t * S) for t in (100, 300, 500)])
    apply_retention(db, Retention(full_ns=300 * S, evidence_ns=5 * S))
    assert _count(db, "SELECT count(*) FROM sample_seconds") == 599 - 3 * 11  # seconds 0..598, less the evidence
    apply_retention(db, Retention(full_ns=300 * S, evidence_ns=5 * S, max_db_bytes=4096))  # far below anything
    assert _count(db, "SELECT count(*) FROM sample_seconds WHERE run_key = ?", key) == 0
    assert _count(db, "SELECT count(*) FROM sample_rows WHERE ts_ns >= ?", 599 * S) == 30100  # the tail, whole
    assert _count(db, "SELECT count(*) FROM sample_rows WHERE ts_ns < ?", 599 * S) == 1100  # the last flag's 495..505 s
    assert _count(db, "SELECT min(ts_ns) FROM sample_rows") == 495 * S
    assert _count(db, "SELECT count(*) FROM flags") == 3


def test_the_sidecar_queues_the_caps_steps_through_its_writer(tmp_path: Path, runtime_dir: Path) -> None:
    from memwatch.sidecar.daemon import Sidecar

    db_path = tmp_path / "m.db"
    db = open_store(db_path)
    _run(db, "done", 60, "ended")
    db.conn.close()
    sidecar = Sidecar(runtime_dir, db_path, detect=False, retention=Retention(max_db_bytes=4096))
    sidecar.start()
    try:
        for _ in range(2):  # one rank per pass
            sidecar.apply_retention()
            assert sidecar.writer.flush(10.0)
    finally:
        sidecar.close()
    db = open_store(db_path, readonly=True)
    assert _count(db, "SELECT count(*) FROM sample_rows") == 0
    assert _count(db, "SELECT count(*) FROM runs WHERE run_id = 'done'") == 1
