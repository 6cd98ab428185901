"""The single writer thread: every row memwatch stores goes through here, in batches.

Why one thread and raw ``executemany``: SQLite allows one writer at a time, and sqlite-utils'
``insert_all`` splits rows into 83-row statements, each committed on its own — about 5× slower
than one ``executemany`` per batch inside one transaction. Callers hand over whole
:class:`Batch` objects; the thread merges what is queued into one transaction, so a batch's rows and
the ring cursor that says they were read are committed together (nothing stored twice after a
restart, nothing skipped).
"""

from __future__ import annotations

import collections
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memwatch.store.db import Database

log = logging.getLogger("memwatch.store")

_NULL = "NULLIF(?, -1)"
INSERT_SAMPLE = (
    "INSERT INTO samples (run_id, rank, step, ts_ns, phase, allocated_bytes, peak_bytes, reserved_bytes,"
    " driver_used_bytes, driver_free_bytes, kv_blocks_used, kv_blocks_total, num_seqs, num_tokens,"
    " step_kind, peak_is_step, process_used_bytes, segments, active_bytes, inactive_split_bytes,"
    " alloc_retries, num_ooms) VALUES (?, ?, ?, ?, ?, "
    + ", ".join([_NULL] * 9) + ", ?, ?, " + ", ".join([_NULL] * 6) + ")"
)
"""Sample rows carry -1 for "not available"; SQLite turns it into NULL without a Python pass.
They go through the ``samples`` view, whose trigger finds (or creates) the run's key."""
INSERT_EVENT = "INSERT INTO events (run_id, rank, step, ts_ns, kind, data) VALUES (?, ?, ?, ?, ?, ?)"
INSERT_FLAG = (
    "INSERT INTO flags (run_id, rank, step, ts_ns, kind, severity, message, data)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
INSERT_SET_ASIDE = (
    "INSERT INTO set_aside (run_id, rank, seq, ts_ns, reason, raw, stored_ns) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
UPSERT_CURSOR = (
    "INSERT INTO ring_cursors (ring, run_id, rank, next_seq, lost, finished) VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT(ring) DO UPDATE SET next_seq = excluded.next_seq, lost = excluded.lost,"
    " finished = excluded.finished"
)


def raw_sample_insert(run_id: str, rank: int, phase_names: dict[int, str | None], ring_version: int = 2,
                      run_key: int | None = None) -> str:
    """An INSERT that stores ring sample tuples exactly as ``RingReader.drain`` returns them.

    The ring's fields are bound by position (``?6`` is the step, ``?8`` the allocated bytes, …; 16 of
    them from a version 1 ring, whose allocator signals are stored as NULL, 21 from version 2); the
    run's key and the rank are in the statement and the phase and step-kind codes are mapped by
    ``CASE``, so no Python code touches each row on its way into SQLite. The rows go straight to
    ``sample_rows`` (the run's ``runs`` row is registered before its first samples). The run's key is
    looked up in ``runs`` for every row until the caller knows it (``run_key``, once registered):
    that lookup is about a sixth of the insert's cost.
    """
    phases = " ".join(f"WHEN {int(code)} THEN {_sql_text(name)}" for code, name in phase_names.items() if name)
    key = str(int(run_key)) if run_key is not None else f"(SELECT run_key FROM runs WHERE run_id = {_sql_text(run_id)})"
    signals = ("NULLIF(?17, -1), NULLIF(?18, -1), NULLIF(?19, -1), NULLIF(?20, -1), NULLIF(?21, -1)"
               if ring_version >= 2 else "NULL, NULL, NULL, NULL, NULL")
    return (
        "INSERT INTO sample_rows (run_key, rank, step, ts_ns, phase, allocated_bytes, peak_bytes, reserved_bytes,"
        " driver_used_bytes, driver_free_bytes, kv_blocks_used, kv_blocks_total, num_seqs, num_tokens,"
        " step_kind, peak_is_step, process_used_bytes, segments, active_bytes, inactive_split_bytes,"
        f" alloc_retries, num_ooms, seq) VALUES ({key}, {int(rank)}, ?6, ?7,"
        f" CASE ?4 {phases} END, NULLIF(?8, -1), NULLIF(?9, -1), NULLIF(?10, -1), NULLIF(?11, -1),"
        " NULLIF(?12, -1), NULLIF(?14, -1), NULLIF(?15, -1), NULLIF(?16, -1), NULLIF(?13, -1),"
        f" CASE ?5 WHEN 1 THEN 'prefill' WHEN 2 THEN 'decode' END, ?3 & 1, NULL, {signals}, ?1)"
        " -- ?2 type unused"
    )


def _sql_text(value: str) -> str:
    return "'" + str(value).replace("\0", "").replace("'", "''") + "'"


@dataclass
class Batch:
    """Rows to store in one transaction. ``statements`` run after the inserts, in order."""

    samples: list[tuple[Any, ...]] = field(default_factory=list)
    """Sample rows in ``samples`` column order, -1 for unknown."""
    ring_samples: list[tuple[str, list[tuple[Any, ...]]]] = field(default_factory=list)
    """(statement from :func:`raw_sample_insert`, ring sample tuples) groups."""
    events: list[tuple[Any, ...]] = field(default_factory=list)
    flags: list[tuple[Any, ...]] = field(default_factory=list)
    cursors: list[tuple[Any, ...]] = field(default_factory=list)
    statements: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    set_aside: list[tuple[Any, ...]] = field(default_factory=list)
    """(run_id, rank, seq, ts_ns, reason, raw bytes) of records that could not be taken."""
    after_commit: list[Callable[[], None]] = field(default_factory=list)
    """Run by the writer thread once this batch's transaction has committed (never if it did not)."""

    def __len__(self) -> int:
        return (len(self.samples) + sum(len(rows) for _, rows in self.ring_samples) + len(self.events)
                + len(self.flags) + len(self.statements) + len(self.set_aside))


ROW_BYTES = 512
"""What one queued row costs in memory, about (a ring sample tuple and its Python ints)."""

_STOP = object()
_BUSY = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}
_FULL = {sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR}


class WriterStalled(Exception):
    """The writer took no new batch within the timeout (its queue stayed full)."""


class StoreWriter(threading.Thread):
    """Owns the write connection. ``submit`` waits a bounded time for queue room; ``flush``/``close`` too.

    The queue is bounded in bytes (``max_bytes``, estimated at :data:`ROW_BYTES` a row), so a
    sidecar catching up on many rings holds a bounded amount of memory: the collector stops draining
    while the queue is full, and the rings hold the rest. A locked database is retried with backoff
    for ``give_up_after`` seconds, then the writer stops with ``error`` set; a full disk is retried
    until space returns (draining pauses meanwhile). A batch SQLite refuses for its content is
    written row by row: a row that cannot be stored is set aside with its bytes, the rest go in.
    """

    def __init__(self, db: Database, *, max_bytes: int = 16 << 20, give_up_after: float = 60.0) -> None:
        super().__init__(name="memwatch-store-writer", daemon=True)
        self._db = db
        # Short waits inside SQLite, retried here: the retry loop sees close() and give_up_after.
        db.conn.execute("PRAGMA busy_timeout = 1000")
        self._queue: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._queued_bytes = 0
        self.max_bytes = max_bytes
        self.give_up_after = give_up_after
        self.rows_written = 0
        self.rows_set_aside = 0
        self.paused: str | None = None
        """Why the writer is waiting (locked database, full disk), while it waits."""
        self.error: BaseException | None = None
        self._closing = False

    @property
    def backlog(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def has_room(self) -> bool:
        """Whether a new batch would be taken now (the collector drains only then)."""
        return self.error is None and self._queued_bytes < self.max_bytes

    def wait_for_room(self, timeout: float) -> bool:
        """Wait at most ``timeout`` until a new batch would be taken (the writer committed what it held)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.error is not None or self._queued_bytes < self.max_bytes, timeout)

    def submit(self, batch: Batch, timeout: float = 10.0) -> None:
        """Queue a batch; waits at most ``timeout`` for room, then raises :class:`WriterStalled`."""
        size = len(batch) * ROW_BYTES
        with self._cond:
            if not self._cond.wait_for(lambda: self.error is not None or self._queued_bytes < self.max_bytes
                                       or not self._queue, timeout):
                raise WriterStalled(f"the store writer took nothing for {timeout:.0f} s")
            if self.error is not None:
                raise RuntimeError(f"the store writer stopped: {self.error}") from self.error
            self._queue.append((batch, size))
            self._queued_bytes += size
            self._cond.notify_all()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is committed; False on timeout or writer failure."""
        done = threading.Event()
        with self._cond:
            self._queue.append((done, 0))
            self._cond.notify_all()
        return done.wait(timeout) and self.error is None

    def close(self, timeout: float = 30.0) -> None:
        """Commit what is queued and stop; a writer still waiting on a locked or full database gives up
        (what it held stays in the rings, its cursors uncommitted)."""
        self._closing = True
        with self._cond:
            self._queue.append((_STOP, 0))
            self._cond.notify_all()
        self.join(timeout)

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # keep the thread's death visible to the sidecar and submitters
            log.error("store writer failed: %s", exc)
            self.error = exc
        finally:
            with self._cond:
                for item, _ in self._queue:
                    if isinstance(item, threading.Event):
                        item.set()
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue), 1.0)
                items = list(self._queue)
                self._queue.clear()
            pending = [item for item, _ in items if isinstance(item, Batch)]
            if pending:
                self._commit(pending)
                for batch in pending:
                    for callback in batch.after_commit:
                        try:
                            callback()
                        except Exception as exc:
                            log.warning("after commit: %s", exc)
            with self._cond:
                self._queued_bytes -= sum(size for _, size in items)
                self._cond.notify_all()
            for item, _ in items:
                if isinstance(item, threading.Event):
                    item.set()
            if any(item is _STOP for item, _ in items):
                return

    def _commit(self, pending: list[Batch]) -> None:
        """One transaction for ``pending``: retried while the database is busy or the disk full."""
        conn = self._db.conn
        delay, first_failure = 0.05, None
        while True:
            try:
                with conn:
                    for batch in pending:
                        self._write(conn, batch)
                if self.paused:
                    log.warning("store writer resumed after: %s", self.paused)
                self.paused = None
                return
            except sqlite3.OperationalError as exc:
                code = getattr(exc, "sqlite_errorcode", None)
                if code not in _BUSY and code not in _FULL:
                    raise
                now = time.monotonic()
                first_failure = first_failure or now
                if code in _BUSY and now - first_failure > self.give_up_after:
                    raise RuntimeError(f"the database stayed locked for {self.give_up_after:.0f} s ({exc})") from None
                if self._closing:
                    raise RuntimeError(f"stopped while waiting: {exc}") from None
                if self.paused is None:
                    self.paused = str(exc)
                    log.warning("store writer paused: %s; draining waits, the rings hold the records; retrying",
                                exc)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except (sqlite3.IntegrityError, sqlite3.InterfaceError, sqlite3.DataError, sqlite3.ProgrammingError,
                    OverflowError, UnicodeError, ValueError) as exc:
                log.warning("store writer: a batch was refused (%s); storing it row by row", exc)
                with conn:
                    for batch in pending:
                        self._write_isolated(conn, batch)
                return

    def _write(self, conn: Any, batch: Batch) -> None:
        if batch.samples:
            conn.executemany(INSERT_SAMPLE, batch.samples)
        for sql, rows in batch.ring_samples:
            conn.executemany(sql, rows)
            self.rows_written += len(rows)
        if batch.events:
            conn.executemany(INSERT_EVENT, batch.events)
        if batch.flags:
            conn.executemany(INSERT_FLAG, batch.flags)
        for sql, params in batch.statements:
            conn.execute(sql, params)
        if batch.set_aside:
            conn.executemany(INSERT_SET_ASIDE, [(*row, time.time_ns()) for row in batch.set_aside])
            self.rows_set_aside += len(batch.set_aside)
        if batch.cursors:
            conn.executemany(UPSERT_CURSOR, batch.cursors)
        self.rows_written += len(batch.samples) + len(batch.events) + len(batch.flags)

    def _write_isolated(self, conn: Any, batch: Batch) -> None:
        """Each row on its own: one that SQLite refuses is set aside (its repr kept), the rest stored."""
        groups = [(INSERT_SAMPLE, batch.samples), *batch.ring_samples, (INSERT_EVENT, batch.events),
                  (INSERT_FLAG, batch.flags)]
        refused = [row for sql, rows in [*groups, *((sql, [p]) for sql, p in batch.statements)]
                   for row in rows if not self._try(conn, sql, row)]
        for row in batch.set_aside:
            self._try(conn, INSERT_SET_ASIDE, (*row, time.time_ns()))
        for row in refused:
            conn.execute(INSERT_SET_ASIDE, (None, None, None, None, "the store refused this row",
                                            repr(row).encode("utf-8", "backslashreplace"), time.time_ns()))
        self.rows_set_aside += len(refused) + len(batch.set_aside)
        if batch.cursors:
            conn.executemany(UPSERT_CURSOR, batch.cursors)

    def _try(self, conn: Any, sql: str, params: Any) -> bool:
        try:
            conn.execute("SAVEPOINT row")
            conn.execute(sql, params)
            conn.execute("RELEASE row")
            self.rows_written += 1
            return True
        except (sqlite3.IntegrityError, sqlite3.InterfaceError, sqlite3.DataError, sqlite3.ProgrammingError,
                sqlite3.OperationalError, OverflowError, UnicodeError, ValueError) as exc:
            log.warning("store writer: set a row aside: %s", exc)
            conn.execute("ROLLBACK TO row")
            conn.execute("RELEASE row")
            return False
