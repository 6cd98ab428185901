"""Retention: older samples rolled up per second per rank, recent ones and the evidence kept whole."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from memwatch.cli import main
from memwatch.sidecar.daemon import Sidecar
from memwatch.store import open_store
from memwatch.store.retention import Retention, apply_retention
from memwatch.store.window import window_rows
from memwatch_engine.ring import RingWriter

from stored_runs import drain

S = 1_000_000_000
STEP_NS = 10_000_000  # 100 steps/s


def _fill(db_path: Path, seconds: int = 100) -> None:
    db = open_store(db_path)
    with db.conn:
        db.execute("INSERT INTO runs (run_id, started_ns) VALUES ('r', 0)")
        db.execute("INSERT INTO ranks (run_id, rank) VALUES ('r', 0), ('r', 1)")
        rows = [("r", rank, step, step * STEP_NS + rank, 1000 + step % 100) for rank in (0, 1)
                for step in range(seconds * 100)]
        db.conn.executemany("INSERT INTO samples (run_id, rank, step, ts_ns, allocated_bytes) VALUES (?, ?, ?, ?, ?)",
                            rows)
        # a spike in second 12 of rank 1, and a flag at 50.5 s on rank 0
        db.execute("UPDATE sample_rows SET allocated_bytes = 999999 WHERE rank = 1 AND step = 1234")
        db.execute("INSERT INTO flags (run_id, rank, step, ts_ns, kind, severity) VALUES "
                   "('r', 0, 5050, ?, 'oom_risk', 'warning')", (50 * S + S // 2,))
    db.conn.close()


def test_old_samples_roll_up_and_the_evidence_stays(db_path: Path) -> None:
    _fill(db_path)
    db = open_store(db_path)
    result = apply_retention(db, Retention(full_ns=20 * S, evidence_ns=5 * S))
    # newest sample at 99.99 s: full resolution from second 79 on; seconds 45..55 around the flag kept
    full_seconds = set(range(45, 56)) | set(range(79, 100))
    rolled_seconds = [s for s in range(100) if s not in full_seconds]
    assert result.rolled_samples == 2 * 100 * len(rolled_seconds)
    raw = db.execute("SELECT DISTINCT ts_ns / 1000000000 FROM sample_rows").fetchall()
    assert {second for (second,) in raw} == full_seconds
    assert db.execute("SELECT count(*), sum(samples) FROM sample_seconds").fetchone() == (
        2 * len(rolled_seconds), 2 * 100 * len(rolled_seconds))
    # every evidence sample of both ranks still there, one by one
    assert db.execute("SELECT count(*) FROM sample_rows WHERE ts_ns >= ? AND ts_ns < ?",
                      (45 * S, 56 * S)).fetchone()[0] == 2 * 11 * 100
    spike = db.execute("SELECT samples, min_allocated_bytes, max_allocated_bytes, last_allocated_bytes, first_step,"
                       " last_step FROM sample_seconds WHERE rank = 1 AND second = 12").fetchone()
    assert spike == (100, 1000, 999999, 1099, 1200, 1299)
    # the timeline reads both, in time order, one row per rolled second
    rows = list(window_rows(db, "r", rank=0))
    assert len(rows) == len(rolled_seconds) + 100 * len(full_seconds)
    assert [row.sample.ts_ns for row in rows] == sorted(row.sample.ts_ns for row in rows)
    # applying it again changes nothing
    assert apply_retention(db, Retention(full_ns=20 * S, evidence_ns=5 * S)).rolled_samples == 0


def test_late_rows_of_a_rolled_second_merge_into_it(db_path: Path) -> None:
    _fill(db_path, seconds=30)
    db = open_store(db_path)
    apply_retention(db, Retention(full_ns=10 * S, evidence_ns=0))
    with db.conn:
        db.execute("INSERT INTO samples (run_id, rank, step, ts_ns, allocated_bytes) VALUES ('r', 0, 9999, ?, 5)",
                   (3 * S + 995 * STEP_NS // 100,))
    apply_retention(db, Retention(full_ns=10 * S, evidence_ns=0))
    row = db.execute("SELECT samples, min_allocated_bytes, last_step FROM sample_seconds WHERE rank = 0 AND second = 3"
                     ).fetchone()
    assert row == (101, 5, 399)  # counted and its minimum taken; the last sample by time is still step 399


def test_the_sidecar_rolls_up_a_running_run_and_keeps_the_minutes_around_its_oom(runtime_dir: Path,
                                                                                   db_path: Path) -> None:
    ring = RingWriter(runtime_dir / "long-r0.ring", run_id="long", capacity=1 << 13, meta={"engine": "test"})
    base = 10**18
    for step in range(6000):  # 60 s at 100 steps/s
        ring.write_sample(step, base + step * STEP_NS, 0, 2, 0, 1 << 30, 1 << 30, 1 << 30, 2 << 30, 6 << 30,
                          64, 10, 100, 4)
    ring.write_event(2000, base + 2000 * STEP_NS, "oom", {"requested_bytes": 1})
    sidecar = Sidecar(runtime_dir, db_path, detect=False, retention=Retention(full_ns=10 * S, evidence_ns=3 * S))
    sidecar.start()
    try:
        sidecar.collector.scan()
        drain(sidecar.collector)
        assert sidecar.writer.flush(timeout=30)
        sidecar.apply_retention()  # the ring is still open: the run is being stored
        assert sidecar.writer.flush(timeout=30)
        db = open_store(db_path, readonly=True)
        # the newest sample is at 59.99 s: seconds 49..59 stay whole, and 17..23 around the OOM at 20 s
        kept = set(range(17, 24)) | set(range(49, 60))
        raw = {s for (s,) in db.execute("SELECT DISTINCT (ts_ns - ?) / 1000000000 FROM sample_rows", (base,))}
        assert raw == kept
        assert db.execute("SELECT count(*) FROM sample_rows").fetchone()[0] == 100 * len(kept)
        assert db.execute("SELECT count(*), sum(samples) FROM sample_seconds").fetchone() == (60 - len(kept),
                                                                                             100 * (60 - len(kept)))
    finally:
        ring.close()
        sidecar.close()


def test_prune_by_hand_reclaims_space_and_the_timeline_still_reads(db_path: Path) -> None:
    _fill(db_path, seconds=300)
    code = CliRunner().invoke(main, ["prune", "--keep-full", "20s", "--keep-evidence", "5s", "--json",
                                     "--db", str(db_path)])
    result = json.loads(code.stdout)
    full_seconds = set(range(45, 56)) | set(range(279, 300))
    assert result["rolled_samples"] == 2 * 100 * (300 - len(full_seconds))
    assert result["vacuumed"] and result["bytes_after"] < result["bytes_before"] / 2
    timeline = CliRunner().invoke(main, ["timeline", "r", "--rank", "1", "--json", "--db", str(db_path)])
    rows = [json.loads(line) for line in timeline.stdout.splitlines()]
    assert len(rows) == (300 - len(full_seconds)) + 100 * len(full_seconds)
    spike = next(row for row in rows if row.get("rolled_up") and row["step"] == 1299)
    assert spike["rolled_up"]["maximum"]["allocated_bytes"] == 999999
    bad = CliRunner().invoke(main, ["prune", "--keep-full", "1m", "--keep-evidence", "2m", "--db", str(db_path)])
    assert bad.exit_code == 2 and "shorter than --keep-full" in bad.stderr
