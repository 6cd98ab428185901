"""The single writer thread: every row memwatch stores goes through here, in batches.

Why one thread and raw ``executemany``: SQLite allows one writer at a time, and sqlite-utils'
``insert_all`` splits rows into 83-row statements, each committed on its own — about 5× slower
than one ``executemany`` per batch inside one transaction. Callers hand over whole
:class:`Batch` objects; the thread merges what is queued into one transaction, so a batch's rows and
the ring cursor that says they were read are committed together (nothing stored twice after a
restart, nothing skipped).
"""

from __future__ import annotations

import logging
import queue
import threading
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
UPSERT_CURSOR = (
    "INSERT INTO ring_cursors (ring, run_id, rank, next_seq, lost, finished) VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT(ring) DO UPDATE SET next_seq = excluded.next_seq, lost = excluded.lost,"
    " finished = excluded.finished"
)


def raw_sample_insert(run_id: str, rank: int, phase_names: dict[int, str | None], ring_version: int = 2) -> str:
    """An INSERT that stores ring sample tuples exactly as ``RingReader.drain`` returns them.

    The ring's fields are bound by position (``?6`` is the step, ``?8`` the allocated bytes, …; 16 of
    them from a version 1 ring, whose allocator signals are stored as NULL, 21 from version 2); the
    run's key and the rank are in the statement and the phase and step-kind codes are mapped by
    ``CASE``, so no Python code touches each row on its way into SQLite. The rows go straight to
    ``sample_rows`` (the run's ``runs`` row is registered before its first samples).
    """
    phases = " ".join(f"WHEN {int(code)} THEN {_sql_text(name)}" for code, name in phase_names.items() if name)
    key = f"(SELECT run_key FROM runs WHERE run_id = {_sql_text(run_id)})"
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

    def __len__(self) -> int:
        return (len(self.samples) + sum(len(rows) for _, rows in self.ring_samples) + len(self.events)
                + len(self.flags) + len(self.statements))


_STOP = object()


class StoreWriter(threading.Thread):
    """Owns the write connection. ``submit`` never blocks on SQLite; ``flush``/``close`` wait."""

    def __init__(self, db: Database, *, max_queue: int = 256) -> None:
        super().__init__(name="memwatch-store-writer", daemon=True)
        self._db = db
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self.rows_written = 0
        self.error: BaseException | None = None

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def submit(self, batch: Batch) -> None:
        if self.error is not None:
            raise RuntimeError(f"the store writer stopped: {self.error}") from self.error
        self._queue.put(batch)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is committed."""
        done = threading.Event()
        self._queue.put(done, timeout=timeout)
        return done.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        self._queue.put(_STOP, timeout=timeout)
        self.join(timeout)

    def run(self) -> None:
        conn = self._db.conn
        while True:
            item = self._queue.get()
            pending: list[Batch] = []
            waiters: list[threading.Event] = []
            stop = False
            while True:
                if item is _STOP:
                    stop = True
                elif isinstance(item, threading.Event):
                    waiters.append(item)
                else:
                    pending.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if pending:
                try:
                    with conn:
                        for batch in pending:
                            self._write(conn, batch)
                except Exception as exc:  # keep the thread's death visible to submitters
                    log.error("store writer failed: %s", exc)
                    self.error = exc
                    for waiter in waiters:
                        waiter.set()
                    return
            for waiter in waiters:
                waiter.set()
            if stop:
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
        if batch.cursors:
            conn.executemany(UPSERT_CURSOR, batch.cursors)
        self.rows_written += len(batch.samples) + len(batch.events) + len(batch.flags)
