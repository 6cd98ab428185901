"""Opening the store: where it lives, how it is tuned, and how a bad file is reported.

Default path: ``$MEMWATCH_DB``, else ``$XDG_DATA_HOME/memwatch/memwatch.db`` (``~/.local/share``).
Writers use WAL with ``synchronous=NORMAL`` (a crash loses at most the last commit, never the file);
readers open the file read-only (``mode=ro``), so ``memwatch sql`` can never change it.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import NotFoundError, PermissionDeniedError, StoreError
from .schema import migrate


class Database:
    """The store's connection, with the few helpers the commands use.

    memwatch used sqlite-utils' ``Database`` for exactly these; importing that package (and numpy
    through it) cost every command more than the rest of its start-up together.
    """

    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, parameters: Sequence[Any] | Mapping[str, Any] = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, parameters)

    def query(self, sql: str, parameters: Sequence[Any] | Mapping[str, Any] = ()) -> Iterator[dict[str, Any]]:
        """Rows as dicts keyed by column name."""
        cursor = self.conn.execute(sql, parameters)
        keys = [column[0] for column in cursor.description or ()]
        for row in cursor:
            yield dict(zip(keys, row, strict=True))

    def table_names(self) -> list[str]:
        return [row[0] for row in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]


def default_db_path() -> Path:
    explicit = os.environ.get("MEMWATCH_DB")
    if explicit:
        return Path(explicit)
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data_home) / "memwatch" / "memwatch.db"


def open_store(path: str | os.PathLike[str] | None = None, *, readonly: bool = False) -> Database:
    """Open (and for writers create and migrate) the store; errors become one-line :class:`MemwatchError`s."""
    db_path = Path(path) if path is not None else default_db_path()
    try:
        if readonly:
            if not db_path.exists():
                raise NotFoundError(
                    f"no memwatch database at {db_path}; run an engine with memwatch, or pass --db / MEMWATCH_DB"
                )
            conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, check_same_thread=False)
        else:
            db_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(db_path, os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
            conn = sqlite3.connect(db_path, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        db = Database(conn)
        if readonly:
            check_schema(db, db_path)
        else:
            migrate(db)
        return db
    except PermissionError:
        raise PermissionDeniedError(f"no permission to open {db_path}; check its owner and mode") from None
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{db_path} is not a usable memwatch database ({exc}); pass another --db") from None


def check_schema(db: Database, db_path: Path) -> None:
    from .schema import SCHEMA_VERSION

    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version == 0:
        raise StoreError(f"{db_path} is not a memwatch database; pass another --db")
    if version > SCHEMA_VERSION:
        raise StoreError(f"{db_path} was written by a newer memwatch (schema {version}); upgrade memwatch")
