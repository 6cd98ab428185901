"""What the store writer stores, in-process: real batches committed by a real :class:`StoreWriter` into a real
SQLite store, read back through a second connection, with the counts and log lines derived by hand."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memwatch.store import open_store
from memwatch.store.sample_insert import raw_sample_insert
from memwatch.store.writer import ROW_BYTES, Batch, StoreWriter

RING = "run1-0.ring"
SAMPLE = ("run1", 0, 1, 1000, "serve", 100, 150, 200, 1000, 9000, 3, 10, 2, 64, "decode", 1, 5000, 4, 90, 10, 0, 0)
"""A sample in ``samples`` column order, every reading known."""
UNKNOWN = ("run1", 0, -1, 2000, "serve", -1, -1, -1, -1, -1, -1, -1, -1, -1, "prefill", 0, -1, -1, -1, -1, -1, -1)
"""A sample with no reading: -1 in every nullable column becomes NULL; the step, not nullable, stays -1."""
RING_SAMPLE = (7, 1, 1, 2, 2, 3, 3000, 110, 160, 210, 1100, 8900, 32, 4, 10, 1, 5, 95, 12, 1, 0)
"""A ring sample tuple: seq, type, flags, phase code, step-kind code, step, ts, allocated, peak, reserved, driver
used, driver free, tokens, KV used, KV total, sequences, segments, active, inactive split, retries, OOMs."""
EVENT = ("run1", 0, 1, 1500, "phase", '{"name": "serve"}')
FLAG = ("run1", 0, 2, 2500, "kv_full", "warning", "KV cache full", "{}")
COLUMNS = ("run_id, rank, step, ts_ns, phase, allocated_bytes, peak_bytes, reserved_bytes, driver_used_bytes,"
           " driver_free_bytes, kv_blocks_used, kv_blocks_total, num_seqs, num_tokens, step_kind, peak_is_step,"
           " process_used_bytes, segments, active_bytes, inactive_split_bytes, alloc_retries, num_ooms")
TALLY = ("UPDATE runs SET rank_count = (SELECT count(*) FROM samples WHERE run_id = ?) * 100"
         " + (SELECT count(*) FROM events) * 10 + (SELECT count(*) FROM flags) WHERE run_id = ?", ("run1", "run1"))
"""Run after the inserts, it sees them: 3 samples, 1 event, 1 flag make 311."""
AFTER_TALLY = ("UPDATE runs SET model = 'after ' || rank_count WHERE run_id = ?", ("run1",))


def _ring_insert(run_id: str = "run1") -> str:
    return raw_sample_insert(run_id, 0, {2: "serve"})


@pytest.fixture
def writer(db_path: Path) -> Iterator[StoreWriter]:
    writer = StoreWriter(open_store(db_path))
    yield writer
    if writer.is_alive():
        writer.close(timeout=10)
    writer._db.conn.close()


def _rows(db_path: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _store(writer: StoreWriter, *batches: Batch) -> None:
    """Queue ``batches`` as one round and wait until it is committed."""
    if not writer.is_alive():
        writer.start()
    with writer.held(longest=10.0):
        for batch in batches:
            writer.submit(batch, timeout=5)
    assert writer.flush(timeout=10)


def test_a_writer_waits_a_second_at_most_inside_sqlite_for_a_lock(writer: StoreWriter) -> None:
    assert writer._db.conn.execute("PRAGMA busy_timeout").fetchone() == (1000,)
    assert (writer.rows_written, writer.rows_set_aside, writer.paused, writer.error) == (0, 0, None, None)
    assert writer.name == "memwatch-store-writer" and writer.daemon


def test_every_kind_of_row_is_stored_and_statements_run_after_the_inserts_in_order(
        writer: StoreWriter, db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="memwatch.store")
    before = time.time_ns()
    batch = Batch(samples=[SAMPLE, UNKNOWN], ring_samples=[(_ring_insert(), [RING_SAMPLE])], events=[EVENT],
                  flags=[FLAG], statements=[TALLY, AFTER_TALLY],
                  set_aside=[("run1", 0, 9, 4000, "bad checksum", b"\x00\x01")],
                  cursors=[(RING, "run1", 0, 8, 0, 0)])
    assert len(batch) == 2 + 1 + 1 + 1 + 2 + 1
    _store(writer, batch)
    after = time.time_ns()
    assert _rows(db_path, f"SELECT {COLUMNS} FROM samples ORDER BY ts_ns") == [
        SAMPLE,
        ("run1", 0, -1, 2000, "serve", *[None] * 9, "prefill", 0, *[None] * 6),
        ("run1", 0, 3, 3000, "serve", 110, 160, 210, 1100, 8900, 4, 10, 1, 32, "decode", 1, None, 5, 95, 12, 1, 0),
    ]
    assert _rows(db_path, "SELECT seq FROM sample_rows WHERE ts_ns = 3000") == [(7,)]
    assert _rows(db_path, "SELECT * FROM events") == [EVENT]
    assert _rows(db_path, "SELECT * FROM flags") == [FLAG]
    assert _rows(db_path, "SELECT rank_count, model FROM runs WHERE run_id = 'run1'") == [(311, "after 311")]
    (aside,) = _rows(db_path, "SELECT * FROM set_aside")
    assert aside[:6] == ("run1", 0, 9, 4000, "bad checksum", b"\x00\x01") and before <= aside[6] <= after
    assert _rows(db_path, "SELECT * FROM ring_cursors") == [(RING, "run1", 0, 8, 0, 0)]
    # Samples, ring samples, events and flags are counted as written; statements and set-aside rows are not.
    assert (writer.rows_written, writer.rows_set_aside) == (5, 1)
    assert (writer.backlog, writer.queued_bytes) == (0, 0)
    assert caplog.records == []  # in one go: nothing refused, nothing set aside row by row


def test_counts_add_up_over_rounds_and_a_cursor_is_moved_not_doubled(writer: StoreWriter, db_path: Path) -> None:
    _store(writer, Batch(samples=[SAMPLE], events=[EVENT], set_aside=[("run1", 0, 8, 1, "w", b"")],
                         cursors=[(RING, "run1", 0, 8, 0, 0)]))
    _store(writer, Batch(ring_samples=[(_ring_insert(), [RING_SAMPLE]),
                                       (_ring_insert(), [(*RING_SAMPLE[:6], 4000, *RING_SAMPLE[7:]),
                                                         (*RING_SAMPLE[:6], 5000, *RING_SAMPLE[7:])])],
                         flags=[FLAG, FLAG], set_aside=[("run1", 0, 9, 1, "x", b""), ("run1", 0, 10, 2, "y", b"")],
                         cursors=[(RING, "run1", 0, 12, 2, 1), ("other.ring", "run2", 1, 3, 0, 0)]))
    assert (writer.rows_written, writer.rows_set_aside) == (2 + 3 + 2, 1 + 2)
    assert _rows(db_path, "SELECT count(*) FROM samples") == [(4,)]
    assert _rows(db_path, "SELECT * FROM ring_cursors ORDER BY ring") == [
        ("other.ring", "run2", 1, 3, 0, 0), (RING, "run1", 0, 12, 2, 1)]


def test_a_round_is_one_transaction_and_a_batch_that_fails_takes_its_cursor_with_it(
        writer: StoreWriter, db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    traced: list[str] = []
    writer._db.conn.set_trace_callback(traced.append)
    _store(writer, Batch(events=[EVENT], cursors=[(RING, "run1", 0, 8, 0, 0)]), Batch(flags=[FLAG]))
    assert [sql for sql in traced if sql in ("BEGIN ", "COMMIT")] == ["BEGIN ", "COMMIT"]
    called: list[str] = []
    doomed = Batch(events=[EVENT], cursors=[(RING, "run1", 0, 99, 0, 0)], statements=[("SELEC 1", ())],
                   after_commit=[lambda: called.append("doomed")])
    with caplog.at_level(logging.WARNING, logger="memwatch.store"):
        _fail(writer, doomed)
    assert _rows(db_path, "SELECT count(*) FROM events") == [(1,)]
    assert _rows(db_path, "SELECT next_seq FROM ring_cursors") == [(8,)]
    assert called == [] and writer.rows_written == 2
    assert [r.getMessage() for r in caplog.records] == ['store writer failed: near "SELEC": syntax error']


def _fail(writer: StoreWriter, batch: Batch) -> None:
    """Submit a batch that stops the writer, with a flush in the same round: the flush says so at once."""
    with writer.held(longest=10.0):
        writer.submit(batch, timeout=5)
        started = time.monotonic()
        assert writer.flush(timeout=20) is False
    assert time.monotonic() - started < 5.0
    writer.join(10)
    assert not writer.is_alive()


def test_a_writer_stopped_by_a_batch_refuses_more_and_says_why(writer: StoreWriter) -> None:
    writer.start()
    _fail(writer, Batch(events=[EVENT, EVENT], statements=[("SELEC 1", ())]))
    assert isinstance(writer.error, sqlite3.OperationalError) and str(writer.error) == 'near "SELEC": syntax error'
    assert (writer.queued_bytes, writer.backlog) == (0, 0)
    assert writer.has_room() is False
    started = time.monotonic()
    assert writer.wait_for_room(10.0) is True
    with pytest.raises(RuntimeError) as raised:
        writer.submit(Batch(events=[EVENT]), timeout=10.0)
    assert str(raised.value) == 'the store writer stopped: near "SELEC": syntax error'
    assert raised.value.__cause__ is writer.error
    assert time.monotonic() - started < 5.0


def test_a_flush_in_the_round_that_stops_the_writer_reads_the_error_set_before_it_was_woken(
        writer: StoreWriter) -> None:
    """The writer logs its death after waking the round's flushes: a handler that holds the log line until the
    flush has answered shows the flush learnt of the failure from the error already set, not from a race."""
    flushed: list[bool] = []

    class HoldTheDeathLine(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            deadline = time.monotonic() + 5
            while record.getMessage().startswith("store writer failed") and not flushed \
                    and time.monotonic() < deadline:
                time.sleep(0.01)

    handler = HoldTheDeathLine()
    logging.getLogger("memwatch.store").addHandler(handler)
    try:
        writer.start()
        with writer.held(longest=10.0):
            writer.submit(Batch(statements=[("SELEC 1", ())]), timeout=5)
            flusher = threading.Thread(target=lambda: flushed.append(writer.flush(timeout=10)))
            flusher.start()
            flusher.join(10)
        writer.join(10)
    finally:
        logging.getLogger("memwatch.store").removeHandler(handler)
    assert flushed == [False] and not writer.is_alive()


class _Died(BaseException):
    pass


def test_a_writer_that_dies_wakes_the_flushes_still_queued(writer: StoreWriter, db_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    flushed: list[bool] = []

    def die() -> None:
        """Runs in the writer thread: a flush is queued behind this round, then the thread dies."""
        flusher = threading.Thread(target=lambda: flushed.append(writer.flush(timeout=20.0)))
        flusher.start()
        deadline = time.monotonic() + 10
        while writer.backlog == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        raise _Died("killed")

    writer.start()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="memwatch.store"):
        writer.submit(Batch(events=[EVENT], after_commit=[die]), timeout=5)
        writer.join(10)
        deadline = time.monotonic() + 10
        while not flushed and time.monotonic() < deadline:
            time.sleep(0.01)
    assert flushed == [False] and time.monotonic() - started < 5.0
    assert isinstance(writer.error, _Died) and not writer.is_alive()
    assert _rows(db_path, "SELECT count(*) FROM events") == [(1,)]  # committed before its callback ran
    assert [r.getMessage() for r in caplog.records] == ["store writer failed: killed"]


def test_after_commit_callbacks_run_once_after_the_commit_and_a_failing_one_stops_no_other(
        writer: StoreWriter, db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[str, int]] = []

    def fails() -> None:
        raise ValueError("boom")

    first = Batch(events=[EVENT], after_commit=[
        lambda: seen.append(("a", _rows(db_path, "SELECT count(*) FROM events")[0][0])), fails])
    second = Batch(events=[EVENT, EVENT], after_commit=[
        lambda: seen.append(("b", _rows(db_path, "SELECT count(*) FROM events")[0][0]))])
    with caplog.at_level(logging.WARNING, logger="memwatch.store"):
        _store(writer, first, second)
        _store(writer, Batch(flags=[FLAG]))
    # Both ran once, in order, each seeing the whole round committed (read from another connection).
    assert seen == [("a", 3), ("b", 3)]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", "after commit: boom")]
    assert writer.error is None and writer.is_alive()


def test_a_refused_batch_is_stored_row_by_row_and_only_its_bad_rows_are_set_aside(
        writer: StoreWriter, db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad_event = ("run1", 0, 2**64, 1600, "x", '{"é": 1}')
    duplicate_run = ("INSERT INTO runs (run_id) VALUES (?)", ("run1",))
    called: list[str] = []
    good = Batch(flags=[FLAG], cursors=[("good.ring", "run3", 0, 5, 0, 0)], after_commit=[lambda: called.append("g")])
    refused = Batch(samples=[SAMPLE], events=[EVENT, bad_event], flags=[FLAG],
                    statements=[("UPDATE runs SET status = ? WHERE run_id = ?", ("ok", "run1")), duplicate_run],
                    set_aside=[("run1", 0, 9, 4000, "bad checksum", b"\xff")], cursors=[(RING, "run1", 0, 8, 0, 0)],
                    after_commit=[lambda: called.append("r")])
    before = time.time_ns()
    with caplog.at_level(logging.WARNING, logger="memwatch.store"):
        _store(writer, good, refused)
    after = time.time_ns()
    assert [r.getMessage() for r in caplog.records] == [
        "store writer: a batch was refused (Python int too large to convert to SQLite INTEGER); "
        "storing it row by row",
        "store writer: set a row aside: Python int too large to convert to SQLite INTEGER",
        "store writer: set a row aside: UNIQUE constraint failed: runs.run_id",
    ]
    assert _rows(db_path, "SELECT count(*) FROM samples") == [(1,)]
    assert _rows(db_path, "SELECT * FROM events") == [EVENT]
    assert _rows(db_path, "SELECT count(*) FROM flags") == [(2,)]
    assert _rows(db_path, "SELECT run_id, status FROM runs") == [("run1", "ok")]
    aside = _rows(db_path, "SELECT * FROM set_aside ORDER BY rowid")
    assert [row[:6] for row in aside] == [
        ("run1", 0, 9, 4000, "bad checksum", b"\xff"),
        (None, None, None, None, "the store refused this row", repr(bad_event).encode("utf-8")),
        (None, None, None, None, "the store refused this row", b"('run1',)"),
    ]
    assert all(before <= row[6] <= after for row in aside)
    assert _rows(db_path, "SELECT ring, next_seq FROM ring_cursors ORDER BY ring") == [("good.ring", 5), (RING, 8)]
    # Counted once, as committed: 2 flags, the sample and an event (the rolled-back first try counts nothing).
    assert (writer.rows_written, writer.rows_set_aside) == (4, 3)
    assert called == ["g", "r"] and writer.error is None


@pytest.mark.parametrize(("row", "why"), [
    (("run1", 0, {}, 1, "k", "{}"), "Error binding parameter 3: type 'dict' is not supported"),
    (("run1", 0, 1, 1, "k", "\ud800"), "'utf-8' codec can't encode character '\\ud800' in position 0: "
                                        "surrogates not allowed"),
    (("run1", 0, 1), "Incorrect number of bindings supplied. The current statement uses 6, and there are 3 "
                     "supplied."),
])
def test_a_row_python_cannot_bind_is_set_aside_with_its_repr(
        writer: StoreWriter, db_path: Path, caplog: pytest.LogCaptureFixture, row: tuple[Any, ...], why: str) -> None:
    with caplog.at_level(logging.WARNING, logger="memwatch.store"):
        _store(writer, Batch(events=[EVENT, row], cursors=[(RING, "run1", 0, 3, 0, 0)]))
    assert [r.getMessage() for r in caplog.records] == [
        f"store writer: a batch was refused ({why}); storing it row by row", f"store writer: set a row aside: {why}"]
    assert _rows(db_path, "SELECT * FROM events") == [EVENT]
    assert _rows(db_path, "SELECT reason, raw FROM set_aside") == [
        ("the store refused this row", repr(row).encode("utf-8"))]
    assert _rows(db_path, "SELECT next_seq FROM ring_cursors") == [(3,)]
    assert (writer.rows_written, writer.rows_set_aside) == (1, 1)


def test_a_sample_of_an_unregistered_ring_run_is_refused_and_the_rest_of_its_group_kept(
        writer: StoreWriter, db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The ring's statement looks the run's key up; for a run with no ``runs`` row it is NULL, which SQLite
    refuses: those rows are set aside, the same round's rows of a known run stored."""
    with caplog.at_level(logging.WARNING, logger="memwatch.store"):
        _store(writer, Batch(samples=[SAMPLE], ring_samples=[(_ring_insert("ghost"), [RING_SAMPLE]),
                                                             (_ring_insert(), [RING_SAMPLE])]))
    refused = "NOT NULL constraint failed: sample_rows.run_key"
    assert [r.getMessage() for r in caplog.records] == [
        f"store writer: a batch was refused ({refused}); storing it row by row",
        f"store writer: set a row aside: {refused}"]
    assert _rows(db_path, "SELECT ts_ns FROM samples ORDER BY ts_ns") == [(1000,), (3000,)]
    assert _rows(db_path, "SELECT raw FROM set_aside") == [(repr(RING_SAMPLE).encode(),)]
    assert (writer.rows_written, writer.rows_set_aside) == (2, 1)


def test_a_batch_costs_its_rows_times_the_row_estimate(writer: StoreWriter) -> None:
    writer.submit(Batch(events=[EVENT] * 3, statements=[TALLY]), timeout=1)
    assert (writer.queued_bytes, writer.backlog) == (4 * ROW_BYTES, 1) and ROW_BYTES == 512
