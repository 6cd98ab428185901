"""The SQLite schema: tables, indexes and the migrations between schema versions.

Table and column names are a public contract (users open the file in ``sqlite3`` or datasette):
byte columns end in ``_bytes``, times in ``_ns`` (Unix epoch nanoseconds), ``NULL`` means "not
available". ``PRAGMA user_version`` holds the schema version; each migration moves it up by one.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlite_utils

from ..errors import StoreError

SCHEMA_VERSION = 1


def _v1(db: sqlite_utils.Database) -> None:
    db["runs"].create(
        {
            "run_id": str, "pid": int, "hostname": str, "engine": str, "model": str, "rank_count": int,
            "started_ns": int, "ended_ns": int, "status": str, "gpu_name": str, "gpu_total_bytes": int,
            "config": str, "source": str,
        },
        pk="run_id",
        defaults={"config": "{}", "status": "running"},
    )
    db["ranks"].create(
        {
            "run_id": str, "rank": int, "pid": int, "device_index": int, "gpu_name": str,
            "gpu_total_bytes": int, "started_ns": int, "ended_ns": int, "status": str,
            "records": int, "lost_records": int, "probe_unavailable": str,
        },
        pk=("run_id", "rank"),
        defaults={"records": 0, "lost_records": 0, "status": "running"},
    )
    db["samples"].create(
        {
            "run_id": str, "rank": int, "step": int, "ts_ns": int, "phase": str,
            "allocated_bytes": int, "peak_bytes": int, "reserved_bytes": int,
            "driver_used_bytes": int, "driver_free_bytes": int,
            "kv_blocks_used": int, "kv_blocks_total": int, "num_seqs": int, "num_tokens": int,
            "step_kind": str, "peak_is_step": int, "process_used_bytes": int,
        }
    )
    db["samples"].create_index(["run_id", "rank", "ts_ns"], index_name="samples_run_rank_ts")
    db["events"].create({"run_id": str, "rank": int, "step": int, "ts_ns": int, "kind": str, "data": str})
    db["events"].create_index(["run_id", "rank", "ts_ns"], index_name="events_run_rank_ts")
    db["flags"].create(
        {
            "run_id": str, "rank": int, "step": int, "ts_ns": int, "kind": str, "severity": str,
            "message": str, "data": str,
        }
    )
    db["flags"].create_index(["run_id", "rank", "ts_ns"], index_name="flags_run_rank_ts")
    db["ring_cursors"].create(
        {"ring": str, "run_id": str, "rank": int, "next_seq": int, "lost": int, "finished": int},
        pk="ring",
        defaults={"lost": 0, "finished": 0},
    )


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_v1]
"""MIGRATIONS[i] takes a database from version i to i + 1."""


def migrate(db: sqlite_utils.Database) -> None:
    """Bring ``db`` to :data:`SCHEMA_VERSION`; refuse a database from a newer memwatch."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the database has schema version {version}, newer than this memwatch ({SCHEMA_VERSION}); "
            "upgrade memwatch"
        )
    if version == 0 and "runs" in db.table_names() and "ring_cursors" not in db.table_names():
        raise StoreError("the database has a 'runs' table but is not a memwatch database; use another --db")
    for step in MIGRATIONS[version:]:
        with db.conn:
            step(db)
            version += 1
            db.execute(f"PRAGMA user_version = {version}")
