"""How long the store writer waits, in-process: a round held while it is queued, the queue's byte cap, bounded
``submit``/``flush``/``close``, a database another connection keeps locked, and a full database."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memwatch.store import open_store
from memwatch.store.writer import ROW_BYTES, Batch, StoreWriter, WriterStalled

EVENT = ("run1", 0, 1, 1500, "phase", "{}")
LOCKED = "database is locked"
FULL = "database or disk is full"
PAUSED = "store writer paused: {}; draining waits, the rings hold the records; retrying"


@pytest.fixture
def writer(db_path: Path) -> Iterator[StoreWriter]:
    writer = StoreWriter(open_store(db_path), give_up_after=30.0)
    yield writer
    if writer.is_alive():
        writer.close(timeout=10)
    writer._db.conn.close()


@pytest.fixture
def lock(db_path: Path, writer: StoreWriter) -> Iterator[sqlite3.Connection]:
    """A second connection holding the write lock (``BEGIN IMMEDIATE``) until the test rolls it back."""
    holder = sqlite3.connect(db_path, isolation_level=None, timeout=0)
    holder.execute("BEGIN IMMEDIATE")
    yield holder
    if holder.in_transaction:
        holder.execute("ROLLBACK")
    holder.close()


def _events(db_path: Path) -> int:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT count(*) FROM events").fetchone()[0]
    finally:
        conn.close()


def _until(check: Callable[[], Any], timeout: float = 5.0) -> float:
    """Seconds until ``check()`` holds (polled every 10 ms); fails past ``timeout``."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, "not within the bound"
        time.sleep(0.01)
    return time.monotonic() - started


def _within(bound: float, call: Callable[[], Any]) -> Any:
    """``call()``'s result, from a thread given ``bound`` seconds: a wait that does not end fails the test."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(bound)
    assert result, f"still waiting after {bound} s"
    return result[0]


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "memwatch.store"]


def test_a_held_round_is_committed_at_its_end_in_one_transaction(writer: StoreWriter, db_path: Path) -> None:
    traced: list[str] = []
    writer._db.conn.set_trace_callback(traced.append)
    writer.start()
    with writer.held(longest=10.0):
        writer.submit(Batch(events=[EVENT, EVENT]), timeout=1)
        writer.submit(Batch(events=[EVENT]), timeout=1)
        time.sleep(0.3)
        assert _events(db_path) == 0
        assert (writer.backlog, writer.queued_bytes) == (2, 3 * ROW_BYTES)
    _until(lambda: _events(db_path) == 3)
    assert traced.count("COMMIT") == 1 and (writer.backlog, writer.queued_bytes) == (0, 0)


def test_a_flush_or_a_close_ends_a_held_round_at_once(writer: StoreWriter, db_path: Path) -> None:
    writer.start()
    with writer.held(longest=10.0):
        writer.submit(Batch(events=[EVENT]), timeout=1)
        started = time.monotonic()
        assert writer.flush(timeout=5) is True
        assert _events(db_path) == 1
        writer.submit(Batch(events=[EVENT]), timeout=1)
        writer.close(timeout=5)
        assert time.monotonic() - started < 3.0
        assert not writer.is_alive() and _events(db_path) == 2


def test_a_held_round_goes_once_held_longest(writer: StoreWriter, db_path: Path) -> None:
    writer.start()
    started = time.monotonic()
    with writer.held(longest=1.3):
        writer.submit(Batch(events=[EVENT]), timeout=1)
        time.sleep(0.2)
        assert _events(db_path) == 0
        # The writer's first wait ends at 1 s; held, it then looks at the clock every 0.1 s: it goes at 1.3 s,
        # not at its next 1 s wait's end.
        _until(lambda: _events(db_path) == 1, timeout=4.0)
        assert 1.25 <= time.monotonic() - started < 1.8


def test_a_held_round_goes_once_the_queue_reaches_its_byte_cap(db_path: Path) -> None:
    writer = StoreWriter(open_store(db_path), max_bytes=3 * ROW_BYTES)
    writer.start()
    try:
        with writer.held(longest=10.0):
            writer.submit(Batch(events=[EVENT, EVENT]), timeout=1)
            assert writer.has_room() is True
            time.sleep(0.2)
            assert _events(db_path) == 0
            writer.submit(Batch(events=[EVENT]), timeout=1)  # 3 rows: the cap, exactly
            assert writer.wait_for_room(5.0) is True
            assert _events(db_path) == 3 and writer.has_room()
    finally:
        writer.close(timeout=5)


def test_room_submit_and_flush_are_bounded_while_nothing_commits(db_path: Path) -> None:
    writer = StoreWriter(open_store(db_path), max_bytes=2 * ROW_BYTES)  # not started yet: nothing commits
    writer.submit(Batch(events=[EVENT]), timeout=0.1)
    assert writer.has_room() is True and writer.queued_bytes == ROW_BYTES
    writer.submit(Batch(events=[EVENT]), timeout=0.1)
    assert writer.has_room() is False and writer.queued_bytes == 2 * ROW_BYTES
    started = time.monotonic()
    assert _within(5, lambda: writer.wait_for_room(0.3)) is False
    assert 0.3 <= time.monotonic() - started < 2.0
    started = time.monotonic()
    with pytest.raises(WriterStalled, match=r"^the store writer took nothing for 1 s$"):
        writer.submit(Batch(events=[EVENT]), timeout=0.6)
    assert 0.6 <= time.monotonic() - started < 2.5
    started = time.monotonic()
    assert _within(5, lambda: writer.flush(timeout=0.3)) is False
    assert 0.3 <= time.monotonic() - started < 2.0
    writer.start()
    assert writer.wait_for_room(5.0) is True and writer.flush(timeout=5) is True
    assert (writer.queued_bytes, writer.backlog, _events(db_path)) == (0, 0, 2)
    writer.close(timeout=5)
    assert not writer.is_alive() and writer.queued_bytes == 0


def test_close_waits_its_bound_at_most_for_a_writer_that_does_not_end(writer: StoreWriter) -> None:
    release = threading.Event()
    writer.start()
    writer.submit(Batch(events=[EVENT], after_commit=[lambda: release.wait(10)]), timeout=1)
    _until(lambda: writer.backlog == 0)
    started = time.monotonic()
    _within(5, lambda: writer.close(timeout=0.3))
    assert 0.3 <= time.monotonic() - started < 2.0 and writer.is_alive()
    release.set()
    writer.join(5)
    assert not writer.is_alive() and writer.error is None


def test_an_idle_writer_sleeps_and_its_defaults_are_as_documented(writer: StoreWriter) -> None:
    writer.start()
    assert writer.flush(timeout=5)
    before = time.process_time()
    time.sleep(0.6)
    assert time.process_time() - before < 0.15  # no thread spinning on an empty queue
    with writer.held():
        time.sleep(0.6)
    assert time.process_time() - before < 0.3
    # Idle past its 1 s wait, the writer still takes the next batch.
    writer.submit(Batch(events=[EVENT]), timeout=1)
    assert writer.flush(timeout=5) and writer.rows_written == 1
    fresh = StoreWriter(writer._db)
    assert (fresh.max_bytes, fresh.give_up_after) == (16 * 1024 * 1024, 60.0)


def test_an_empty_queue_takes_a_batch_larger_than_the_cap(db_path: Path) -> None:
    writer = StoreWriter(open_store(db_path), max_bytes=1)
    writer.submit(Batch(events=[EVENT] * 4), timeout=0.1)
    assert writer.queued_bytes == 4 * ROW_BYTES and not writer.has_room()
    with pytest.raises(WriterStalled):
        writer.submit(Batch(events=[EVENT]), timeout=0.1)
    writer.start()
    writer.close(timeout=5)
    assert _events(db_path) == 4 and writer.error is None


def test_a_locked_database_is_waited_out_and_the_pause_logged_once(
        writer: StoreWriter, lock: sqlite3.Connection, db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer._db.conn.execute("PRAGMA busy_timeout = 0")  # each try fails at once: the writer's backoff is tested
    caplog.set_level(logging.WARNING, logger="memwatch.store")
    writer.start()
    writer.submit(Batch(events=[EVENT]), timeout=1)
    _until(lambda: writer.paused == LOCKED)
    time.sleep(0.5)  # several tries, one line
    assert _messages(caplog) == [PAUSED.format(LOCKED)] and writer.is_alive()
    lock.execute("ROLLBACK")
    assert writer.flush(timeout=5) is True
    writer.submit(Batch(events=[EVENT]), timeout=1)
    assert writer.flush(timeout=5) is True
    assert writer.paused is None and _events(db_path) == 2 and writer.rows_written == 2
    assert _messages(caplog) == [PAUSED.format(LOCKED), f"store writer resumed after: {LOCKED}"]


def test_a_lock_that_stays_is_given_up_after_its_bound(
        db_path: Path, lock: sqlite3.Connection, caplog: pytest.LogCaptureFixture) -> None:
    writer = StoreWriter(open_store(db_path), give_up_after=2.0)
    tries: list[str] = []
    writer._db.conn.execute("PRAGMA busy_timeout = 0")
    writer._db.conn.set_trace_callback(lambda sql: tries.append(sql) if sql == "BEGIN " else None)
    caplog.set_level(logging.WARNING, logger="memwatch.store")
    writer.start()
    started = time.monotonic()
    writer.submit(Batch(events=[EVENT]), timeout=1)
    writer.join(10)
    took = time.monotonic() - started
    # Tries at 0, 0.05, 0.15, 0.35, 0.75, 1.55 s (waits doubling from 50 ms to 1 s at most), then 2.55 s: past
    # 2 s, given up (waits up to 1.6 s would try next at 3.15 s).
    assert len(tries) == 7 and 2.5 <= took < 3.0
    message = f"the database stayed locked for 2 s ({LOCKED})"
    assert isinstance(writer.error, RuntimeError) and str(writer.error) == message
    assert _messages(caplog) == [PAUSED.format(LOCKED), f"store writer failed: {message}"]
    assert writer.flush(timeout=0.1) is False
    writer._db.conn.close()


def test_close_gives_up_a_wait_on_a_lock(writer: StoreWriter, lock: sqlite3.Connection, db_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    writer._db.conn.execute("PRAGMA busy_timeout = 0")
    caplog.set_level(logging.WARNING, logger="memwatch.store")
    writer.start()
    writer.submit(Batch(events=[EVENT], cursors=[("r.ring", "run1", 0, 9, 0, 0)]), timeout=1)
    _until(lambda: writer.paused == LOCKED)
    started = time.monotonic()
    writer.close(timeout=5)
    assert time.monotonic() - started < 3.0 and not writer.is_alive()
    assert str(writer.error) == f"stopped while waiting: {LOCKED}"
    assert _messages(caplog) == [PAUSED.format(LOCKED), f"store writer failed: stopped while waiting: {LOCKED}"]
    lock.execute("ROLLBACK")
    assert _events(db_path) == 0  # the rows stay in the rings, their cursor unmoved


def test_a_full_database_is_waited_out_past_the_lock_bound(
        db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SQLite's page limit makes the database full for real (SQLITE_FULL, as a full disk does); a full disk is
    waited on for as long as it lasts, not ``give_up_after``."""
    writer = StoreWriter(open_store(db_path), give_up_after=0.2)
    conn = writer._db.conn
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages}")
    caplog.set_level(logging.WARNING, logger="memwatch.store")
    writer.start()
    try:
        writer.submit(Batch(events=[("run1", 0, step, step, "x", "x" * 200) for step in range(100)]), timeout=1)
        _until(lambda: writer.paused == FULL)
        time.sleep(0.6)
        assert writer.is_alive() and writer.error is None and _events(db_path) == 0
        conn.execute("PRAGMA max_page_count = 1000000")
        assert writer.flush(timeout=10) is True
        assert _events(db_path) == 100 and writer.rows_written == 100 and writer.paused is None
        assert _messages(caplog) == [PAUSED.format(FULL), f"store writer resumed after: {FULL}"]
    finally:
        writer.close(timeout=5)
        conn.close()
