"""A bundle's ``run.db``: accepted only as memwatch's own schema, read from memory, under a time bound.

A forger who may write the bucket may write a whole bundle, checksums included, so what ``run.db`` *is* gets
checked too: a database is a program as much as data (a view runs a query, a generated column an expression, a
trigger a statement). It is accepted only when

* its header is memwatch's: SQLite's, UTF-8, a rollback journal (the build writes ``journal_mode=DELETE``);
* its schema version is one this memwatch knows, and ``sqlite_master`` holds exactly the tables, indexes, view and
  triggers memwatch's own migrations create at that version, SQL text included: :func:`reference_schema` builds
  them in memory with :data:`memwatch.store.schema.MIGRATIONS`, not from a list kept by hand. No view, trigger,
  table, index, virtual table, hidden or generated column of its own, and none of memwatch's missing.

Every connection to it has ``trusted_schema=OFF``, ``query_only=ON``, temporary tables in memory and a progress
handler that interrupts any statement once :data:`READ_SECONDS` have passed since the bundle was opened (extension
loading is never enabled). The database is never written to a file: its bytes are loaded into SQLite's memory
(``deserialize``), then copied into a shared in-memory database (the ``memdb`` VFS) that every reading command opens
by name through :func:`memwatch.store.db.connect_readonly`, from threads and forked children alike. So reading a
bundle needs no writable folder: no ``$TMPDIR``, no working directory.

``events.jsonl`` is written from the ``events`` rows of ``run.db`` (one ``json.dumps`` line a row), so it can be at
most :func:`events_bound` bytes: per row 172 bytes of keys, separators and numbers, and 6 bytes per byte of its
text (``\\u00e9`` for ``é``: JSON's widest escape is 6 characters for one byte).

SQL is written in triple-quoted blocks: SQLite reads keywords, names and pragmas in any case.
"""

from __future__ import annotations

import itertools
import sqlite3
import threading
import time
from collections.abc import Callable
from functools import cache
from urllib.parse import quote

from ..store.db import Database, hold_in_memory
from ..store.schema import MIGRATIONS, SCHEMA_VERSION
from .manifest import BundleError

READ_SECONDS = 25.0
"""How long a bundle may be read, from its opening: a reading command ends within 30 s whatever the bundle."""
PROGRESS_STEPS = 10_000
"""SQLite virtual-machine steps between two looks at the clock (a few microseconds of work)."""
HEADER = b"SQLite format 3\x00"
EVENT_ROW_BYTES = 172
"""An event's line less its text: ``{"data": , "kind": , "rank": , "step": , "ts_ns": }`` and a newline (52), and
five values' quotes, ``null`` or a number's digits (24 each at most: ``-2.2250738585072014e-308``)."""
EVENT_TEXT_FACTOR = 6
"""JSON's widest escape of one byte: a control character as ``\\u0001``."""

_names = itertools.count(1)
_lock = threading.Lock()


@cache
def reference_schema(version: int) -> frozenset[tuple[str, str, str, str | None]]:
    """``(type, name, table, sql)`` of every entry of ``sqlite_master`` memwatch's migrations create up to
    ``version``, made in an in-memory database."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        db = Database(conn)
        for step in MIGRATIONS[:version]:
            step(db)
        return frozenset(conn.execute("""SELECT type, name, tbl_name, sql FROM sqlite_master"""))
    finally:
        conn.close()


def guard(conn: sqlite3.Connection, deadline: float) -> sqlite3.Connection:
    """``conn`` made safe to read a bundle with: nothing in its schema trusted, nothing written, nothing spilled to a
    temporary file, no statement run past ``deadline`` (``time.monotonic()``)."""
    conn.set_progress_handler(lambda: time.monotonic() > deadline, PROGRESS_STEPS)
    conn.execute("""PRAGMA trusted_schema=OFF""")
    conn.execute("""PRAGMA query_only=ON""")
    conn.execute("""PRAGMA temp_store=MEMORY""")
    return conn


def check_header(data: bytes | bytearray) -> None:
    """The first 100 bytes are those of a database memwatch writes: SQLite's, a rollback journal, UTF-8."""
    if len(data) < 100 or bytes(data[:16]) != HEADER:
        raise BundleError("its run.db is not a SQLite database, so not a memwatch database")
    if data[18] != 1 or data[19] != 1:
        raise BundleError("its run.db is in WAL mode, which memwatch never writes into a bundle; not a memwatch "
                          "database")
    if int.from_bytes(data[56:60], "big") != 1:
        raise BundleError("its run.db is not UTF-8, as memwatch writes it; not a memwatch database")


def check_schema(conn: sqlite3.Connection) -> int:
    """Its schema version, when ``sqlite_master`` is exactly memwatch's at that version: else :class:`BundleError`
    naming the first entry that differs."""
    version = conn.execute("""PRAGMA user_version""").fetchone()[0]
    if not 1 <= version <= SCHEMA_VERSION:
        raise BundleError(f"its run.db is not a memwatch database (schema version {version}; memwatch's are 1 to "
                          f"{SCHEMA_VERSION})")
    found = frozenset(conn.execute("""SELECT type, name, tbl_name, sql FROM sqlite_master"""))
    expected = reference_schema(version)
    ours = {(kind, name) for kind, name, _, _ in expected}
    programs_first = {"view": 0, "trigger": 1}  # what would run is named before what merely is there
    for kind, name, _, _ in sorted(found - expected, key=lambda entry: (programs_first.get(entry[0], 2), entry[:2])):
        if (kind, name) in ours:
            raise BundleError(f"its run.db's {kind} {name!r} is not as memwatch creates it (a column, constraint or "
                              "definition of its own); a bundle is data, never a program: refusing it")
        raise BundleError(f"its run.db holds a {kind} {name[:80]!r} that memwatch does not create; a bundle is data, "
                          "never a program: refusing it")
    for kind, name, _, _ in sorted(expected - found):
        raise BundleError(f"its run.db lacks memwatch's {kind} {name!r}; not a memwatch database")
    return version


def events_bound(conn: sqlite3.Connection) -> int:
    """The most bytes the build could write as ``events.jsonl`` from this database's ``events`` rows."""
    rows, size = conn.execute("""
        SELECT count(*), coalesce(sum(coalesce(length(CAST(rank AS BLOB)), 0)
                                      + coalesce(length(CAST(step AS BLOB)), 0)
                                      + coalesce(length(CAST(ts_ns AS BLOB)), 0)
                                      + coalesce(length(CAST(kind AS BLOB)), 0)
                                      + coalesce(length(CAST(data AS BLOB)), 0)), 0)
        FROM events""").fetchone()
    return EVENT_ROW_BYTES * rows + EVENT_TEXT_FACTOR * size


def inspect(data: bytearray, deadline: float, *,
            keep: Callable[[sqlite3.Connection], None] | None = None) -> dict[str, int]:
    """Check ``data`` as a bundle's ``run.db`` (every rule of the module's docstring): the bounds it sets on the
    members that follow it. ``keep`` gets the checked database before it is closed. ``data`` is emptied once
    SQLite holds its copy, so that the bytes are held twice only for that moment."""
    check_header(data)
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    try:
        try:
            conn.deserialize(data)
            data.clear()
            guard(conn, deadline)
            check_schema(conn)
            bounds = {"events.jsonl": events_bound(conn)}
            if keep is not None:
                keep(conn)
        except sqlite3.DatabaseError as exc:
            if time.monotonic() > deadline:
                raise BundleError(f"its run.db took over {READ_SECONDS:.0f} s to check; refusing it") from None
            raise BundleError(f"its run.db cannot be read as a memwatch database ({' '.join(str(exc).split())[:120]})"
                              ) from None
    finally:
        conn.close()
    return bounds


class HeldDatabase:
    """A checked ``run.db`` in SQLite's memory under :attr:`name`, which every reading command opens as its ``--db``
    until :meth:`close`."""

    def __init__(self, source: sqlite3.Connection, deadline: float) -> None:
        with _lock:
            self.name = f"/memwatch-bundle-{next(_names)}/run.db"
        self._uri = f"file:{quote(self.name)}?vfs=memdb"
        self._deadline = deadline
        self._conn: sqlite3.Connection | None = sqlite3.connect(self._uri, uri=True, isolation_level=None,
                                                                check_same_thread=False)
        source.backup(self._conn)
        guard(self._conn, deadline)
        hold_in_memory(self.name, self.connect)

    def connect(self) -> sqlite3.Connection:
        """One more read-only, guarded connection to it (a command's reader, a thread's, a forked child's)."""
        return guard(sqlite3.connect(f"{self._uri}&mode=ro", uri=True, check_same_thread=False), self._deadline)

    def close(self) -> None:
        hold_in_memory(self.name, None)
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def load(data: bytearray, deadline: float) -> tuple[HeldDatabase, dict[str, int]]:
    """:func:`inspect` ``data``, then hold it in memory: the held database and the bounds it sets."""
    held: list[HeldDatabase] = []
    bounds = inspect(data, deadline, keep=lambda conn: held.append(HeldDatabase(conn, deadline)))
    return held[0], bounds
