"""The SQLite schema: tables, indexes and the migrations between schema versions.

Table and column names are a public contract (users open the file in ``sqlite3`` or datasette):
byte columns end in ``_bytes``, times in ``_ns`` (Unix epoch nanoseconds), ``NULL`` means "not
available". ``PRAGMA user_version`` holds the schema version; each migration moves it up by one.

Samples are the bulk of the file, so they are stored compactly in ``sample_rows``, keyed by the
integer ``runs.run_key`` instead of the text run id. ``samples`` is a view that joins the run id back
in, with the same columns as before; inserting into it still works (a trigger stores the row), so
ad-hoc writers and queries need not know about the key. Samples older than the retention window
are rolled up per second per rank into ``sample_seconds`` (see :mod:`memwatch.store.retention`).

To add a sample column in a later migration: ``ALTER TABLE sample_rows ADD COLUMN …``, add it to
:data:`ROLLUP_COLUMNS` if it is a number worth rolling up (and add its ``min_``/``max_``/``last_``
columns to ``sample_seconds``), then call :func:`create_sample_view` to rebuild the view and trigger.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import StoreError

if TYPE_CHECKING:
    from memwatch.store.db import Database

SCHEMA_VERSION = 9

ROLLUP_COLUMNS: tuple[str, ...] = (
    "allocated_bytes", "peak_bytes", "reserved_bytes", "driver_used_bytes", "driver_free_bytes",
    "kv_blocks_used", "kv_blocks_total", "num_seqs", "num_tokens", "process_used_bytes",
)
"""Numeric sample columns kept per second as ``min_<col>``, ``max_<col>`` and ``last_<col>`` once rolled up."""


_V1_TABLES = (
    """CREATE TABLE runs (run_id TEXT PRIMARY KEY, pid INTEGER, hostname TEXT, engine TEXT, model TEXT,
       rank_count INTEGER, started_ns INTEGER, ended_ns INTEGER, status TEXT DEFAULT 'running', gpu_name TEXT,
       gpu_total_bytes INTEGER, config TEXT DEFAULT '{}', source TEXT)""",
    """CREATE TABLE ranks (run_id TEXT, rank INTEGER, pid INTEGER, device_index INTEGER, gpu_name TEXT,
       gpu_total_bytes INTEGER, started_ns INTEGER, ended_ns INTEGER, status TEXT DEFAULT 'running',
       records INTEGER DEFAULT 0, lost_records INTEGER DEFAULT 0, probe_unavailable TEXT,
       PRIMARY KEY (run_id, rank))""",
    """CREATE TABLE samples (run_id TEXT, rank INTEGER, step INTEGER, ts_ns INTEGER, phase TEXT,
       allocated_bytes INTEGER, peak_bytes INTEGER, reserved_bytes INTEGER, driver_used_bytes INTEGER,
       driver_free_bytes INTEGER, kv_blocks_used INTEGER, kv_blocks_total INTEGER, num_seqs INTEGER,
       num_tokens INTEGER, step_kind TEXT, peak_is_step INTEGER, process_used_bytes INTEGER)""",
    "CREATE INDEX samples_run_rank_ts ON samples (run_id, rank, ts_ns)",
    "CREATE TABLE events (run_id TEXT, rank INTEGER, step INTEGER, ts_ns INTEGER, kind TEXT, data TEXT)",
    "CREATE INDEX events_run_rank_ts ON events (run_id, rank, ts_ns)",
    """CREATE TABLE flags (run_id TEXT, rank INTEGER, step INTEGER, ts_ns INTEGER, kind TEXT, severity TEXT,
       message TEXT, data TEXT)""",
    "CREATE INDEX flags_run_rank_ts ON flags (run_id, rank, ts_ns)",
    """CREATE TABLE ring_cursors (ring TEXT PRIMARY KEY, run_id TEXT, rank INTEGER, next_seq INTEGER,
       lost INTEGER DEFAULT 0, finished INTEGER DEFAULT 0)""",
)


def _v1(db: Database) -> None:
    """The first schema: one row per run, rank, sample, event, flag and ring cursor."""
    for statement in _V1_TABLES:
        db.execute(statement)


_SAMPLE_ROW_COLUMNS = (
    "rank INTEGER NOT NULL, step INTEGER, ts_ns INTEGER NOT NULL, phase TEXT, allocated_bytes INTEGER,"
    " peak_bytes INTEGER, reserved_bytes INTEGER, driver_used_bytes INTEGER, driver_free_bytes INTEGER,"
    " kv_blocks_used INTEGER, kv_blocks_total INTEGER, num_seqs INTEGER, num_tokens INTEGER, step_kind TEXT,"
    " peak_is_step INTEGER, process_used_bytes INTEGER"
)


def _v2(db: Database) -> None:
    """Integer run key, compact sample rows, the per-second rollup and the live per-rank summaries."""
    conn = db.conn
    conn.execute("ALTER TABLE runs ADD COLUMN run_key INTEGER")
    conn.execute("UPDATE runs SET run_key = rowid")
    conn.execute("CREATE UNIQUE INDEX runs_run_key ON runs (run_key)")
    # Every new run gets the next key, whoever inserts it (the collector, attach --record, a script).
    conn.execute(
        "CREATE TRIGGER runs_key AFTER INSERT ON runs WHEN NEW.run_key IS NULL BEGIN"
        f" UPDATE runs SET run_key = {NEXT_RUN_KEY} WHERE rowid = NEW.rowid; END"
    )
    # Runs that have samples but no runs row (written by hand) get one, so that no sample is lost.
    conn.execute(
        "INSERT INTO runs (run_id, run_key, status) SELECT DISTINCT s.run_id,"
        " (SELECT coalesce(max(run_key), 0) FROM runs) + dense_rank() OVER (ORDER BY s.run_id), 'unknown'"
        " FROM samples s WHERE s.run_id NOT IN (SELECT run_id FROM runs)"
    )
    conn.execute(f"CREATE TABLE sample_rows (run_key INTEGER NOT NULL, {_SAMPLE_ROW_COLUMNS})")
    columns = [row[1] for row in conn.execute("PRAGMA table_info(samples)") if row[1] != "run_id"]
    conn.execute(
        f"INSERT INTO sample_rows (run_key, {', '.join(columns)})"
        f" SELECT r.run_key, {', '.join('s.' + c for c in columns)}"
        " FROM samples s JOIN runs r ON r.run_id = s.run_id ORDER BY s.rowid"
    )
    conn.execute("DROP TABLE samples")
    conn.execute("CREATE INDEX sample_rows_key_rank_ts ON sample_rows (run_key, rank, ts_ns)")
    rolled = ", ".join(f"min_{c} INTEGER, max_{c} INTEGER, last_{c} INTEGER" for c in ROLLUP_COLUMNS)
    conn.execute(
        "CREATE TABLE sample_seconds (run_key INTEGER NOT NULL, rank INTEGER NOT NULL, second INTEGER NOT NULL,"
        " samples INTEGER NOT NULL, first_ts_ns INTEGER, last_ts_ns INTEGER, first_step INTEGER, last_step INTEGER,"
        f" last_phase TEXT, last_step_kind TEXT, {rolled}, PRIMARY KEY (run_key, rank, second)) WITHOUT ROWID"
    )
    conn.execute(
        "CREATE TABLE rank_summaries (run_id TEXT NOT NULL, rank INTEGER NOT NULL, complete INTEGER NOT NULL,"
        " detector_config TEXT, samples INTEGER, last_step INTEGER, last_ts_ns INTEGER, summary TEXT,"
        " PRIMARY KEY (run_id, rank))"
    )
    create_sample_view(db)


def create_sample_view(db: Database) -> None:
    """(Re)create the ``samples`` view over ``sample_rows`` and the trigger that makes it insertable."""
    conn = db.conn
    stored = [row[1] for row in conn.execute("PRAGMA table_info(sample_rows)")]
    columns = [column for column in stored if column not in ("run_key", "seq")]
    conn.execute("DROP TRIGGER IF EXISTS samples_insert")
    conn.execute("DROP VIEW IF EXISTS samples")
    conn.execute(
        f"CREATE VIEW samples AS SELECT r.run_id AS run_id, {', '.join('s.' + c + ' AS ' + c for c in columns)}"
        " FROM sample_rows s JOIN runs r ON r.run_key = s.run_key"
    )
    key = "(SELECT run_key FROM runs WHERE run_id = NEW.run_id)"
    seq_column, seq_value = "", ""
    if "seq" in stored:  # rows of a rank at the same time are told apart by their order of arrival
        seq_column = ", seq"
        seq_value = (f", coalesce((SELECT max(seq) + 1 FROM sample_rows WHERE run_key = {key} AND rank = NEW.rank"
                     " AND ts_ns = NEW.ts_ns), 0)")
    conn.execute(
        "CREATE TRIGGER samples_insert INSTEAD OF INSERT ON samples BEGIN"
        f" {ENSURE_RUN.replace('?', 'NEW.run_id')};"
        f" INSERT INTO sample_rows (run_key, {', '.join(columns)}{seq_column}) VALUES"
        f" ({key}, {', '.join('NEW.' + c for c in columns)}{seq_value});"
        " END"
    )


ALLOCATOR_COLUMNS: tuple[str, ...] = ("segments", "active_bytes", "inactive_split_bytes", "alloc_retries", "num_ooms")
"""The allocator's own signals per sample (NULL in rows from version 1 rings, NVML runs and older databases).
Not rolled up: seconds past the retention window keep the allocator's and driver's totals only."""


def _v3(db: Database) -> None:
    """The allocator's signals: segments, active and inactive-split bytes, retries, OOM count."""
    for column in ALLOCATOR_COLUMNS:
        db.conn.execute(f"ALTER TABLE sample_rows ADD COLUMN {column} INTEGER")
    create_sample_view(db)


def _v4(db: Database) -> None:
    """Rolled-up seconds keep their largest step rise (``peak - allocated`` of a step's own peak), which
    the ledger's forward need, and so the OOM margin of every later sample, depends on."""
    db.conn.execute("ALTER TABLE sample_seconds ADD COLUMN max_step_rise_bytes INTEGER")


def _v5(db: Database) -> None:
    """Per rank per minute, the range of the terms explain searches by and the largest step rise, kept live."""
    db.conn.execute(
        "CREATE TABLE serving_minutes (run_id TEXT NOT NULL, rank INTEGER NOT NULL, minute INTEGER NOT NULL,"
        " min_non_torch_bytes INTEGER, max_non_torch_bytes INTEGER, min_cache_slack_bytes INTEGER,"
        " max_cache_slack_bytes INTEGER, min_allocated_bytes INTEGER, max_allocated_bytes INTEGER,"
        " max_step_rise_bytes INTEGER, PRIMARY KEY (run_id, rank, minute)) WITHOUT ROWID"
    )


def _v6(db: Database) -> None:
    """Samples clustered by run, rank and time (``WITHOUT ROWID``, key ``run_key, rank, ts_ns, seq``).

    A rank's window is then a run of neighbouring pages instead of one row in every few pages of the
    whole run, and the separate index (a third of each sample's bytes) is gone. ``seq`` tells apart
    rows of one rank at the same time: the ring's sequence number, or the order of arrival (0 by
    default, for writers that name the columns and never store two rows of a rank at one time).
    """
    conn = db.conn
    info = list(conn.execute("PRAGMA table_info(sample_rows)"))
    names = [row[1] for row in info]
    definitions = [f"{row[1]} {row[2]}{' NOT NULL' if row[3] else ''}" for row in info]
    conn.execute("DROP TRIGGER IF EXISTS samples_insert")
    conn.execute("DROP VIEW IF EXISTS samples")
    conn.execute(f"CREATE TABLE sample_rows_clustered ({', '.join(definitions)}, seq INTEGER NOT NULL DEFAULT 0,"
                 " PRIMARY KEY (run_key, rank, ts_ns, seq)) WITHOUT ROWID")
    conn.execute(f"INSERT INTO sample_rows_clustered ({', '.join(names)}, seq)"
                 f" SELECT {', '.join(names)}, rowid FROM sample_rows")
    conn.execute("DROP TABLE sample_rows")
    conn.execute("ALTER TABLE sample_rows_clustered RENAME TO sample_rows")
    create_sample_view(db)


NEXT_RUN_KEY = "(SELECT coalesce(max(run_key), 0) + 1 FROM runs)"
"""The key a new run gets (``runs.run_key`` is unique; the next free integer)."""
ENSURE_RUN = (
    f"INSERT INTO runs (run_id, run_key, status) SELECT ?, {NEXT_RUN_KEY}, 'running'"
    " WHERE NOT EXISTS (SELECT 1 FROM runs WHERE run_id = ?)"
)
"""Create a bare ``runs`` row for a run id that has none (bind the run id twice)."""


def _v7(db: Database) -> None:
    """``set_aside``: records the sidecar could not decode or store, kept with their bytes for a bug report."""
    db.execute("CREATE TABLE set_aside (run_id TEXT, rank INTEGER, seq INTEGER, ts_ns INTEGER, reason TEXT,"
               " raw BLOB, stored_ns INTEGER)")


def _v8(db: Database) -> None:
    """Where a run ran: its Kubernetes namespace, pod, container and node, and its container's id (NULL
    outside a container and for older runs)."""
    for column in ("k8s_namespace", "k8s_pod", "k8s_container", "k8s_node", "container_id"):
        db.execute(f"ALTER TABLE runs ADD COLUMN {column} TEXT")


NOW_NS = "(CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) * 1000000)"
"""SQLite's clock as Unix epoch nanoseconds (to the millisecond)."""
ENDED_BADLY = ("crashed", "oom", "error")
"""A run's statuses that owe an incident bundle."""


def _v9(db: Database) -> None:
    """``incidents``: each incident bundle owed, decided in the transaction that stores its cause (the run's bad
    ending, a critical flag), so a sidecar killed before the bundle is built builds it at its next start. At most
    one per run and trigger; forgotten with the run."""
    db.execute("CREATE TABLE incidents (run_id TEXT NOT NULL, trigger TEXT NOT NULL, decided_ns INTEGER NOT NULL,"
               " state TEXT NOT NULL DEFAULT 'owed', bundle TEXT, note TEXT, PRIMARY KEY (run_id, trigger))")
    db.execute("CREATE INDEX incidents_state ON incidents (state, decided_ns)")
    bad = ", ".join(f"'{status}'" for status in ENDED_BADLY)
    db.execute(f"CREATE TRIGGER incidents_ended AFTER UPDATE OF status ON runs WHEN NEW.status IN ({bad})"
               " AND OLD.status IS NOT NEW.status BEGIN INSERT OR IGNORE INTO incidents (run_id, trigger, decided_ns)"
               f" VALUES (NEW.run_id, NEW.status, {NOW_NS}); END")
    db.execute("CREATE TRIGGER incidents_flagged AFTER INSERT ON flags WHEN NEW.severity = 'critical' BEGIN"
               " INSERT OR IGNORE INTO incidents (run_id, trigger, decided_ns)"
               f" VALUES (NEW.run_id, NEW.kind, {NOW_NS}); END")
    db.execute("CREATE TRIGGER incidents_forgotten AFTER DELETE ON runs BEGIN"
               " DELETE FROM incidents WHERE run_id = OLD.run_id; END")


MIGRATIONS: list[Callable[[Database], None]] = [_v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9]
"""MIGRATIONS[i] takes a database from version i to i + 1."""


def migrate(db: Database) -> None:
    """Bring ``db`` to :data:`SCHEMA_VERSION`; refuse a database from a newer memwatch."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the database has schema version {version}, newer than this memwatch ({SCHEMA_VERSION}); "
            "upgrade memwatch"
        )
    if version == 0 and "runs" in db.table_names() and "ring_cursors" not in db.table_names():
        raise StoreError("the database has a 'runs' table but is not a memwatch database; use another --db")
    conn = db.conn
    for step in MIGRATIONS[version:]:
        conn.execute("BEGIN IMMEDIATE")  # DDL included: a migration happens whole or not at all
        try:
            step(db)
            version += 1
            conn.execute(f"PRAGMA user_version = {version}")
        except BaseException:
            conn.rollback()
            raise
        conn.commit()
