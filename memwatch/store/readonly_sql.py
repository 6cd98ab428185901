"""Ad-hoc SQL on the store that cannot change it: read-only file, ``query_only``, and an authorizer.

Three locks, each enough on its own for writes to the file: the connection is opened with
``mode=ro``, ``PRAGMA query_only`` is on, and an authorizer refuses every action that writes
(INSERT, UPDATE, DELETE, CREATE, DROP, ALTER), ATTACH/DETACH, and pragmas that set a value. The
authorizer also gives the user one plain reason instead of SQLite's "attempt to write a readonly
database". Only one statement runs, and it must start with SELECT, WITH, VALUES, EXPLAIN or PRAGMA.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import NotFoundError, StoreError, UsageError

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
        if action in _WRITES:
            self.refused = self.refused or _WRITES[action]
            return sqlite3.SQLITE_DENY
        reading = (arg1 or "").lower() in _READ_PRAGMAS_WITH_ARGUMENT
        if action == sqlite3.SQLITE_PRAGMA and arg2 is not None and not reading:
            self.refused = self.refused or f"PRAGMA {arg1} = {arg2}"
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK


def _first_word(sql: str) -> str:
    text = re.sub(r"(--[^\n]*\n?|/\*.*?\*/|\s)+", " ", sql, flags=re.S).strip()
    return text.split(" ", 1)[0].split("(", 1)[0].lower() if text else ""


def run_query(db_path: Path, sql: str, params: tuple[Any, ...] = ()) -> tuple[list[str], Iterator[tuple[Any, ...]]]:
    """Column names and rows of one read-only statement; :class:`UsageError` for anything that would write."""
    word = _first_word(sql)
    if word not in _STARTS:
        what = word.upper() or "an empty statement"
        raise UsageError(f"memwatch sql runs queries only and {what} is not one; start with SELECT, WITH or PRAGMA")
    if not db_path.exists():
        raise NotFoundError(f"no memwatch database at {db_path}; pass --db or set MEMWATCH_DB")
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    conn.execute("PRAGMA query_only = ON")
    conn.execute("PRAGMA busy_timeout = 5000")
    guard = _Guard()
    conn.set_authorizer(guard)
    try:
        cursor = conn.execute(sql, params)
    except sqlite3.DatabaseError as exc:
        conn.close()
        if guard.refused is not None:
            raise UsageError(f"memwatch sql is read-only: {guard.refused} is refused and nothing was changed; "
                             "copy the database to change a copy") from None
        message = str(exc)
        if "one statement at a time" in message:
            raise UsageError("memwatch sql runs one statement at a time; keep only the first") from None
        if isinstance(exc, sqlite3.OperationalError | sqlite3.ProgrammingError):
            raise UsageError(f"the query failed: {message}; see the tables in the README's data section") from None
        raise StoreError(f"{db_path} could not be read ({message})") from None
    columns = [d[0] for d in cursor.description or ()]

    def rows() -> Iterator[tuple[Any, ...]]:
        try:
            yield from cursor
        except sqlite3.DatabaseError as exc:
            raise UsageError(f"the query failed while reading: {exc}") from None
        finally:
            conn.close()

    return columns, rows()
