"""Ad-hoc SQL on the store that cannot change it: read-only file, ``query_only``, and an authorizer.

Three locks, each enough on its own for writes to the file: the connection is opened with
``mode=ro``, ``PRAGMA query_only`` is on, and an authorizer refuses every action that writes
(INSERT, UPDATE, DELETE, CREATE, DROP, ALTER), ATTACH/DETACH, and pragmas that set a value. The
authorizer also gives the user one plain reason instead of SQLite's "attempt to write a readonly
database". Only one statement runs, and it must start with SELECT, WITH, VALUES, EXPLAIN or PRAGMA.
What cannot write is allowed: a table-valued pragma (``pragma_table_info('runs')``) reads the schema,
which SQLite asks the authorizer about as an UPDATE of ``sqlite_master``'s columns (that table cannot
be written here at all).

A query runs under a progress handler that stops it past ``timeout_s`` or once Ctrl-C was pressed:
SQLite never returns to Python during one long step (an endless recursive CTE), so a plain
KeyboardInterrupt would wait for ever.
"""

from __future__ import annotations

import math
import re
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import MemwatchError, StoreError, UsageError
from .db import connect_readonly, store_error

DEFAULT_TIMEOUT_S = 60.0
PROGRESS_STEPS = 1000
"""SQLite virtual-machine steps between two looks at the clock and the Ctrl-C flag."""
_SCHEMA_TABLES = frozenset({"sqlite_master", "sqlite_schema", "sqlite_temp_master", "sqlite_temp_schema"})
_SCHEMA_COLUMNS = frozenset({"type", "name", "tbl_name", "rootpage", "sql"})


class QueryInterrupted(MemwatchError):
    """Ctrl-C stopped the query: the shell's convention, 128 + SIGINT."""

    exit_code = 130

_STARTS = ("select", "with", "values", "explain", "pragma")
_READ_PRAGMAS_WITH_ARGUMENT = frozenset({
    "table_info", "table_xinfo", "index_list", "index_info", "index_xinfo", "foreign_key_list", "table_list",
    "function_list", "pragma_list", "collation_list", "module_list",
})
_WRITES = {
    sqlite3.SQLITE_INSERT: "INSERT", sqlite3.SQLITE_UPDATE: "UPDATE", sqlite3.SQLITE_DELETE: "DELETE",
    sqlite3.SQLITE_ATTACH: "ATTACH", sqlite3.SQLITE_DETACH: "DETACH",
    sqlite3.SQLITE_ALTER_TABLE: "ALTER", sqlite3.SQLITE_REINDEX: "REINDEX", sqlite3.SQLITE_ANALYZE: "ANALYZE",
}
for _name in dir(sqlite3):
    if _name.startswith(("SQLITE_CREATE_", "SQLITE_DROP_")):
        _WRITES[getattr(sqlite3, _name)] = _name.split("_")[1]


class _Guard:
    """An authorizer that remembers what it refused, to say so in one line."""

    def __init__(self) -> None:
        self.refused: str | None = None

    def __call__(self, action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
        if action == sqlite3.SQLITE_UPDATE and arg1 in _SCHEMA_TABLES and arg2 in _SCHEMA_COLUMNS:
            return sqlite3.SQLITE_OK  # a table-valued pragma reading the schema; sqlite_master is never writable
        if action in _WRITES:
            self.refused = self.refused or _WRITES[action]
            return sqlite3.SQLITE_DENY
        reading = (arg1 or "").lower() in _READ_PRAGMAS_WITH_ARGUMENT
        if action == sqlite3.SQLITE_PRAGMA and arg2 is not None and not reading:
            self.refused = self.refused or f"PRAGMA {arg1} = {arg2}"
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK


class _Stopper:
    """The progress handler: non-zero (SQLite stops the statement) past the deadline or after Ctrl-C."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.deadline = None if not timeout_s else time.monotonic() + timeout_s
        self.interrupted = False
        self.why: str | None = None

    def __call__(self) -> int:
        if self.interrupted:
            self.why = "interrupted"
        elif self.deadline is not None and time.monotonic() > self.deadline:
            self.why = "timeout"
        return 1 if self.why else 0

    def on_sigint(self, _signum: int, _frame: Any) -> None:
        self.interrupted = True

    def error(self) -> MemwatchError:
        if self.why == "interrupted":
            return QueryInterrupted("the query was stopped by Ctrl-C; nothing was changed")
        return UsageError(f"the query ran longer than {self.timeout_s:g}s (the --timeout limit) and was stopped; "
                          "narrow it (a WHERE on run_id, a LIMIT) or raise --timeout (0: no limit)")


def _catch_sigint(stopper: _Stopper) -> Callable[[], None]:
    """Ctrl-C sets the stopper's flag while the query runs; returns what puts the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGINT, stopper.on_sigint)
    return lambda: signal.signal(signal.SIGINT, previous)


def _first_word(sql: str) -> str:
    text = re.sub(r"(--[^\n]*\n?|/\*.*?\*/|\s)+", " ", sql, flags=re.S).strip()
    return text.split(" ", 1)[0].split("(", 1)[0].lower() if text else ""


def run_query(db_path: Path, sql: str, params: tuple[Any, ...] = (), *,
              timeout_s: float | None = DEFAULT_TIMEOUT_S) -> tuple[list[str], Iterator[tuple[Any, ...]]]:
    """Column names and rows (streamed) of one read-only statement; :class:`UsageError` for anything that would write.

    ``timeout_s`` bounds the whole query, rows included (``None`` or 0: no bound); Ctrl-C stops it.
    """
    word = _first_word(sql)
    if word not in _STARTS:
        what = word.upper() or "an empty statement"
        raise UsageError(f"memwatch sql runs queries only and {what} is not one; start with SELECT, WITH or PRAGMA")
    if timeout_s is not None and not 0 <= timeout_s < math.inf:  # a NaN compares false: it was no limit at all
        raise UsageError(f"the query timeout must be a finite number of seconds, 0 or more (0: no limit); got "
                         f"{timeout_s}")
    conn = connect_readonly(db_path)
    try:
        conn.execute("PRAGMA query_only = ON")
        conn.execute("PRAGMA busy_timeout = 5000")
        conn.execute("PRAGMA user_version").fetchone()  # opens the file: a reason to refuse it comes now
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise store_error(db_path, exc, readonly=True) from None
    guard = _Guard()
    conn.set_authorizer(guard)
    stopper = _Stopper(timeout_s)
    conn.set_progress_handler(stopper, PROGRESS_STEPS)
    restore = _catch_sigint(stopper)
    try:
        cursor = conn.execute(sql, params)
    except sqlite3.DatabaseError as exc:
        conn.close()
        restore()
        if stopper.why is not None:
            raise stopper.error() from None
        if guard.refused is not None:
            raise UsageError(f"memwatch sql is read-only: {guard.refused} is refused and nothing was changed; "
                             "copy the database to change a copy") from None
        message = str(exc)
        if "one statement at a time" in message:
            raise UsageError("memwatch sql runs one statement at a time; keep only the first") from None
        if isinstance(exc, sqlite3.OperationalError | sqlite3.ProgrammingError):
            raise UsageError(f"the query failed: {message}; see the tables in docs/storage.md (The data)") from None
        raise StoreError(f"{db_path} could not be read ({message})") from None
    columns = [d[0] for d in cursor.description or ()]

    def rows() -> Iterator[tuple[Any, ...]]:
        try:
            for row in cursor:
                if stopper():
                    raise stopper.error()
                yield row
        except sqlite3.DatabaseError as exc:
            if stopper.why is not None:
                raise stopper.error() from None
            raise UsageError(f"the query failed while reading: {exc}") from None
        finally:
            conn.close()
            restore()

    return columns, rows()
