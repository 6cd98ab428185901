"""A run's rows copied into a bundle's ``run.db``, and its full-resolution window shortened to fit the cap.

The copy is a new database of this memwatch's schema holding one run: its rows (``runs``, ``ranks``, events, flags,
summaries) and its samples at full resolution and per second. When the bundle is over its cap, :func:`shorten` rolls
the oldest full-resolution seconds up, as retention does, and :func:`full_from` says where the window now begins.
Statements are triple-quoted blocks: SQLite reads their keywords and names in any case.
"""

from __future__ import annotations

import os
import sqlite3
from urllib.parse import quote

from ..store.db import Database, open_store, readonly_uri
from ..store.retention import Retention, plan_run

RUN_TABLES = ("runs", "ranks", "events", "flags", "rank_summaries", "serving_minutes")
"""Tables copied by ``run_id``; ``sample_rows`` and ``sample_seconds`` are copied by the run's key. Rows set aside
as undecodable (``set_aside``: another process's raw bytes) and ring cursors stay on the node."""
KEY_TABLES = ("sample_rows", "sample_seconds")
KEY_COLUMN = {**dict.fromkeys(RUN_TABLES, "run_id"), **dict.fromkeys(KEY_TABLES, "run_key")}
"""The column that names one run's rows in each copied table."""


def copy_run(source: str, target: str, run_id: str) -> None:
    """The run's rows, with the schema of this memwatch, into a new database file ``target``.

    A table that holds this run's rows only, in a source of this schema, is copied whole (``INSERT … SELECT *``,
    which SQLite copies record by record without decoding them: three times faster on the samples); any other
    by the run's key."""
    open_store(target).conn.close()
    conn = sqlite3.connect(f"file:{quote(os.fsencode(target))}", uri=True)
    try:
        conn.execute("""PRAGMA journal_mode=DELETE""")  # one file, no -wal, when read from the bundle
        conn.execute("""PRAGMA synchronous=OFF""")  # a scratch file: the archive is synced, not it
        conn.execute("""PRAGMA cache_size=-65536""")
        conn.execute("""ATTACH DATABASE ? AS src""", (readonly_uri(source),))
        same_schema = conn.execute("""PRAGMA src.user_version""").fetchone()[0] == \
            conn.execute("""PRAGMA main.user_version""").fetchone()[0]
        key = conn.execute("""SELECT run_key FROM src.runs WHERE run_id = ?""", (run_id,)).fetchone()
        with conn:
            for table in (*RUN_TABLES, *KEY_TABLES):
                theirs = [row[1] for row in conn.execute(f"PRAGMA src.table_info({table})")]
                ours = [row[1] for row in conn.execute(f"PRAGMA main.table_info({table})")]
                columns = [column for column in ours if column in theirs]
                if not columns:
                    continue
                where = KEY_COLUMN[table]
                param = run_id if table in RUN_TABLES else key[0] if key else None
                if same_schema and theirs == ours and _only(conn, table, where, param):
                    conn.execute(f"INSERT INTO main.{table} SELECT * FROM src.{table}")
                    continue
                names = ", ".join(columns)
                conn.execute(f"INSERT INTO main.{table} ({names}) SELECT {names} FROM src.{table} WHERE {where} = ?",
                             (param,))
            conn.execute("""DELETE FROM main.incidents""")  # what the copy's own triggers decided: it owes none
        conn.execute("""DETACH DATABASE src""")  # a new file filled in key order has no free pages: no VACUUM
    finally:
        conn.close()


def _only(conn: sqlite3.Connection, table: str, column: str, value: object) -> bool:
    """Whether every row of ``src.table`` has ``column = value`` (its first key column: one index look-up)."""
    low = conn.execute(f"SELECT min({column}) FROM src.{table}").fetchone()[0]  # one aggregate a query: else a
    high = conn.execute(f"SELECT max({column}) FROM src.{table}").fetchone()[0]  # scan of the whole table
    return low is not None and low == high == value


def full_from(database: str) -> int | None:
    """The first full-resolution sample's time: the least of each rank's first (a few look-ups of the samples'
    key, ``run_key, rank, ts_ns``, where ``min(ts_ns)`` alone would read them all)."""
    conn = sqlite3.connect(database)
    try:
        first: int | None = None
        for (key,) in conn.execute("""SELECT run_key FROM runs""").fetchall():
            rank = conn.execute("""SELECT min(rank) FROM sample_rows WHERE run_key = ?""", (key,)).fetchone()[0]
            while rank is not None:
                ts = conn.execute("""SELECT min(ts_ns) FROM sample_rows WHERE run_key = ? AND rank = ?""",
                                  (key, rank)).fetchone()[0]
                first = ts if first is None or ts < first else first
                rank = conn.execute("""SELECT min(rank) FROM sample_rows WHERE run_key = ? AND rank > ?""",
                                    (key, rank)).fetchone()[0]
        return first
    finally:
        conn.close()


def full_span(database: str) -> int:
    conn = sqlite3.connect(database)
    try:
        low, high = conn.execute("""SELECT min(ts_ns), max(ts_ns) FROM sample_rows""").fetchone()
    finally:
        conn.close()
    return 0 if low is None else high - low


def shorten(database: str, run_id: str, keep_ns: int) -> int:
    """Roll up the run's full-resolution samples older than ``keep_ns`` before its last one; the seconds rolled."""
    conn = sqlite3.connect(database)
    try:
        db = Database(conn)
        before = conn.execute("""SELECT count(*) FROM sample_seconds""").fetchone()[0]
        with conn:
            for sql, params in plan_run(db, run_id, Retention(full_ns=keep_ns, evidence_ns=0, rollups_ns=None)):
                conn.execute(sql, params)
        after = conn.execute("""SELECT count(*) FROM sample_seconds""").fetchone()[0]
        conn.execute("""VACUUM""")
        return max(after - before, 0)
    finally:
        conn.close()
