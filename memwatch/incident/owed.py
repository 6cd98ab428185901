"""The incident bundles owed, as the database records them (its ``incidents`` table, :mod:`memwatch.store.schema`).

A row is written by SQLite itself, in the transaction that stores the cause: the ``runs`` update that ends a run
``crashed``, ``oom`` or ``error``, the insert of a critical flag (triggers ``incidents_ended`` and
``incidents_flagged``), or here for a shutdown. So the decision to bundle is as durable as its evidence, and a
sidecar that starts finds every bundle still owed. A row's ``state``:

* ``owed``: decided, nothing built yet;
* ``building``: its bundle's name chosen (``bundle``), the build begun: a sidecar that finds the name in its build
  folder or spool knows it was built, else builds it again under the same name (so it ships once);
* ``built``: published in the build folder (then handed to the spool);
* ``merged`` (a flag's, folded into the bundle of the run's bad ending), ``dropped`` (rate limit, run no longer
  stored) or ``failed`` (a bundle that can never be built: over its cap): done, ``note`` says why.

Statements are triple-quoted blocks: SQLite reads their keywords and names in any case.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from ..store.db import Database, open_store

OWED, BUILDING, BUILT, MERGED, DROPPED, FAILED = "owed", "building", "built", "merged", "dropped", "failed"
BATCH = 256
"""The most rows one round looks at (the oldest first)."""


@dataclass(frozen=True)
class Owed:
    """One bundle still owed, with its run's status now (``None``: the run is no longer stored)."""

    run_id: str
    trigger: str
    decided_ns: int
    state: str
    bundle: str | None
    status: str | None


class Ledger:
    """The ``incidents`` rows, read and updated on a connection of its own (opened on first use, reopened after an
    error: the database may be full or locked for a while)."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self._db: Database | None = None
        self._lock = threading.Lock()  # the builder's thread, the shutdown, the spool's drops: one at a time

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = open_store(self.db_path)
        return self._db.conn

    def _run(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        with self._lock:
            try:
                conn = self._conn()
                with conn:
                    return list(conn.execute(sql, params))
            except Exception:
                self._close()
                raise

    def owed(self) -> list[Owed]:
        """The rows not yet built, oldest decision first."""
        rows = self._run("""
            SELECT i.run_id, i.trigger, i.decided_ns, i.state, i.bundle, r.status
            FROM incidents i LEFT JOIN runs r ON r.run_id = i.run_id
            WHERE i.state IN (?, ?) ORDER BY i.decided_ns, i.run_id, i.trigger LIMIT ?""", (OWED, BUILDING, BATCH))
        return [Owed(*row) for row in rows]  # type: ignore[arg-type]

    def decide(self, run_id: str, trigger: str, decided_ns: int) -> bool:
        """Record a bundle owed (a shutdown's); False when one for this run and trigger was already decided."""
        return bool(self._run("""
            INSERT OR IGNORE INTO incidents (run_id, trigger, decided_ns) VALUES (?, ?, ?) RETURNING 1""",
                              (run_id, trigger, decided_ns)))

    def mark(self, row: Owed, state: str, bundle: str | None = None, note: str | None = None) -> None:
        self._run("""
            UPDATE incidents SET state = ?, bundle = coalesce(?, bundle), note = ? WHERE run_id = ? AND trigger = ?""",
                  (state, bundle, note, row.run_id, row.trigger))

    def taken(self, name: str) -> bool:
        """Whether a decided bundle already has the name ``name``."""
        return bool(self._run("""SELECT 1 FROM incidents WHERE bundle = ? LIMIT 1""", (name,)))

    def oldest_owed_ns(self) -> int | None:
        """When the oldest bundle still owed was decided (``None``: none is)."""
        [(value,)] = self._run("""SELECT min(decided_ns) FROM incidents WHERE state IN (?, ?)""", (OWED, BUILDING))
        return None if value is None else int(value)  # an aggregate: always one row

    def bundle_dropped(self, name: str, size: int, why: str, now_ns: int) -> None:
        """The spool dropped the bundle ``name``: its row says so, and its run gets a ``bundle_dropped`` event."""
        data = json.dumps({"bundle": name, "bytes": size, "why": why})
        self._run("""
            INSERT INTO events (run_id, rank, step, ts_ns, kind, data)
            SELECT run_id, NULL, NULL, ?, 'bundle_dropped', ? FROM incidents WHERE bundle = ?""", (now_ns, data, name))
        self._run("""UPDATE incidents SET state = ?, note = ? WHERE bundle = ?""", (DROPPED, why, name))

    def refused(self, row: Owed, why: str, now_ns: int) -> None:
        """``row``'s bundle is not built (the per-uid rate): its run gets a ``bundle_dropped`` event saying why, as a
        bundle dropped from the spool does, so the run's own events tell why it has no bundle."""
        data = json.dumps({"trigger": row.trigger, "why": why})
        self._run("""
            INSERT INTO events (run_id, rank, step, ts_ns, kind, data)
            SELECT run_id, NULL, NULL, ?, 'bundle_dropped', ? FROM runs WHERE run_id = ?""", (now_ns, data, row.run_id))

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._db is not None:
            try:
                self._db.conn.close()
            finally:
                self._db = None
