"""The ledger of bundles owed, on a real database: what a builder reads, records and is told, in numbers by hand."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from memwatch.incident import owed
from memwatch.store import open_store


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    path = tmp_path / "memwatch.db"
    db = open_store(path)
    with db.conn:
        db.conn.executemany("INSERT INTO runs (run_id, status) VALUES (?, ?)",
                            [("a", "running"), ("b", "crashed"), ("c", "ok")])
        db.conn.executemany("INSERT INTO incidents (run_id, trigger, decided_ns, state, bundle) VALUES (?, ?, ?, ?, ?)",
                            [("b", "crashed", 30, "owed", None), ("a", "oom_risk", 20, "building", "x.tar.gz"),
                             ("c", "torch_drift", 10, "built", "y.tar.gz"), ("gone", "error", 5, "owed", None)])
    db.conn.close()
    return path


def _rows(db_path: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(db_path)
    try:
        return list(conn.execute(sql))
    finally:
        conn.close()


def test_the_bundles_still_owed_come_oldest_first_with_their_runs_status(db_path: Path) -> None:
    ledger = owed.Ledger(db_path)
    assert ledger.owed() == [  # the built one is done; a run no longer stored has no status
        owed.Owed("gone", "error", 5, "owed", None, None),
        owed.Owed("a", "oom_risk", 20, "building", "x.tar.gz", "running"),
        owed.Owed("b", "crashed", 30, "owed", None, "crashed")]
    assert ledger.oldest_owed_ns() == 5
    ledger.close()


def test_a_decision_is_made_once_and_a_mark_keeps_the_name_chosen(db_path: Path) -> None:
    ledger = owed.Ledger(db_path)
    assert ledger.decide("c", "shutdown", 40) and not ledger.decide("c", "shutdown", 41)
    [row] = [r for r in ledger.owed() if r.trigger == "shutdown"]
    assert row == owed.Owed("c", "shutdown", 40, "owed", None, "ok")
    ledger.mark(row, owed.BUILDING, bundle="z.tar.gz")
    ledger.mark(row, owed.BUILT)  # no name given: the one chosen stays
    assert _rows(db_path, "SELECT state, bundle, note FROM incidents WHERE trigger = 'shutdown'") == [
        ("built", "z.tar.gz", None)]
    assert ledger.taken("z.tar.gz") and ledger.taken("x.tar.gz") and not ledger.taken("w.tar.gz")
    ledger.mark(owed.Owed("gone", "error", 5, "owed", None, None), owed.DROPPED, note="the run is no longer stored")
    assert _rows(db_path, "SELECT run_id, state, note FROM incidents WHERE state = 'dropped'") == [
        ("gone", "dropped", "the run is no longer stored")]
    assert [r.run_id for r in ledger.owed()] == ["a", "b"] and ledger.oldest_owed_ns() == 20
    ledger.close()


def test_a_bundle_dropped_from_the_spool_is_recorded_in_its_row_and_as_its_runs_event(db_path: Path) -> None:
    ledger = owed.Ledger(db_path)
    ledger.bundle_dropped("y.tar.gz", 1234, "the spool is full", 99)
    assert _rows(db_path, "SELECT run_id, state, note FROM incidents WHERE bundle = 'y.tar.gz'") == [
        ("c", "dropped", "the spool is full")]
    [(run_id, rank, step, ts, kind, data)] = _rows(db_path, "SELECT run_id, rank, step, ts_ns, kind, data FROM events")
    assert (run_id, rank, step, ts, kind) == ("c", None, None, 99, "bundle_dropped")
    assert data == '{"bundle": "y.tar.gz", "bytes": 1234, "why": "the spool is full"}'
    ledger.close()


def test_nothing_owed_is_none_and_a_closed_ledger_opens_again(tmp_path: Path) -> None:
    ledger = owed.Ledger(tmp_path / "empty.db")
    ledger.close()  # never opened: nothing to close
    assert ledger.owed() == [] and ledger.oldest_owed_ns() is None
    ledger.close()
    assert ledger._db is None
    assert ledger.decide("r", "shutdown", 1)  # opened again on use
    ledger.close()
