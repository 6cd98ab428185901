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
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
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


HOLD_LIMIT_S = 2.0
"""The longest the writer waits for a round of batches to be queued (:meth:`StoreWriter.held`)."""
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
        """Sample, event and flag rows committed (statements and set-aside records not counted)."""
        self.rows_set_aside = 0
        """Records committed to ``set_aside``: the batches' own and the rows SQLite refused."""
        self.paused: str | None = None
        """Why the writer is waiting (locked database, full disk), while it waits."""
        self.error: BaseException | None = None
        self._closing = False
        self._held_until = 0.0
        """While a round of batches is being queued (:meth:`held`): until when at the latest (monotonic)."""

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

    @contextlib.contextmanager
    def held(self, longest: float = HOLD_LIMIT_S) -> Iterator[None]:
        """While the caller queues a round of batches, commit nothing unless the queue fills (or a flush, a
        close, or ``longest`` seconds come): then the round goes as one transaction, after the caller's work.

        The two threads share one interpreter lock, which ``executemany`` gives up and takes again for every
        row: interleaved with the collector's decoding and detecting, each side pays for the other's turns.
        """
        with self._cond:
            self._held_until = time.monotonic() + longest
        try:
            yield
        finally:
            with self._cond:
                self._held_until = 0.0
                self._cond.notify_all()

    def _ready(self) -> bool:
        """Whether the writer takes what is queued now (called under the condition's lock)."""
        if not self._queue:
            return False
        if self._held_until <= 0.0 or self._queued_bytes >= self.max_bytes or time.monotonic() >= self._held_until:
            return True
        return any(not isinstance(item, Batch) for item, _ in self._queue)  # a flush or a close

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._ready, 0.1 if self._held_until else 1.0)
                if not self._ready():
                    continue
                items = list(self._queue)
                self._queue.clear()
            pending = [item for item, _ in items if isinstance(item, Batch)]
            try:
                if pending:
                    self._commit(pending)
                    for batch in pending:
                        for callback in batch.after_commit:
                            try:
                                callback()
                            except Exception as exc:
                                log.warning("after commit: %s", exc)
            except BaseException as exc:
                self.error = exc  # before the flushes taken with this round are woken: they read it
                raise
            finally:
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
                    counts = [self._write(conn, batch) for batch in pending]
                self._count(counts)
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
                    counts = [self._write_isolated(conn, batch) for batch in pending]
                self._count(counts)
                return

    def _count(self, counts: list[tuple[int, int]]) -> None:
        """Add a committed round's rows: a round rolled back (retried, or refused and stored row by row) counts
        nothing, so each row is counted once."""
        self.rows_written += sum(written for written, _ in counts)
        self.rows_set_aside += sum(aside for _, aside in counts)

    def _write(self, conn: Any, batch: Batch) -> tuple[int, int]:
        """Insert ``batch``; the sample, event and flag rows written and the records set aside."""
        if batch.samples:
            conn.executemany(INSERT_SAMPLE, batch.samples)
        for sql, rows in batch.ring_samples:
            conn.executemany(sql, rows)
        if batch.events:
            conn.executemany(INSERT_EVENT, batch.events)
        if batch.flags:
            conn.executemany(INSERT_FLAG, batch.flags)
        for sql, params in batch.statements:
            conn.execute(sql, params)
        if batch.set_aside:
            conn.executemany(INSERT_SET_ASIDE, [(*row, time.time_ns()) for row in batch.set_aside])
        if batch.cursors:
            conn.executemany(UPSERT_CURSOR, batch.cursors)
        return len(batch) - len(batch.statements) - len(batch.set_aside), len(batch.set_aside)

    def _write_isolated(self, conn: Any, batch: Batch) -> tuple[int, int]:
        """Each row on its own: one that SQLite refuses is set aside (its repr kept), the rest stored."""
        groups = [(INSERT_SAMPLE, batch.samples), *batch.ring_samples, (INSERT_EVENT, batch.events),
                  (INSERT_FLAG, batch.flags)]
        refused = [row for sql, rows in groups for row in rows if not self._try(conn, sql, row)]
        written = len(batch) - len(batch.statements) - len(batch.set_aside) - len(refused)
        refused += [params for sql, params in batch.statements if not self._try(conn, sql, params)]
        for row in batch.set_aside:
            self._try(conn, INSERT_SET_ASIDE, (*row, time.time_ns()))
        for row in refused:
            raw = repr(row).encode("utf-8", "backslashreplace")  # pragma: no mutate (repr escapes surrogates)
            conn.execute(INSERT_SET_ASIDE, (None, None, None, None, "the store refused this row", raw, time.time_ns()))
        if batch.cursors:
            conn.executemany(UPSERT_CURSOR, batch.cursors)
        return written, len(refused) + len(batch.set_aside)

    def _try(self, conn: Any, sql: str, params: Any) -> bool:
        try:
            conn.execute("SAVEPOINT row")  # pragma: no mutate (SQLite ignores case in keywords and savepoint names)
            conn.execute(sql, params)
            conn.execute("RELEASE row")  # pragma: no mutate (SQLite ignores case in keywords and savepoint names)
            return True
        except (sqlite3.IntegrityError, sqlite3.InterfaceError, sqlite3.DataError, sqlite3.ProgrammingError,
                sqlite3.OperationalError, OverflowError, UnicodeError, ValueError) as exc:
            log.warning("store writer: set a row aside: %s", exc)
            conn.execute("ROLLBACK TO row")  # pragma: no mutate (SQLite ignores case in keywords and savepoint names)
            conn.execute("RELEASE row")  # pragma: no mutate (SQLite ignores case in keywords and savepoint names)
            return False
