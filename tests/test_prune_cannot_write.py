"""How ``memwatch prune`` tells a database it may only read from a damaged one, on SQLite's own errors."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from memwatch.cli.prune import _cannot_write


def _error_of(run: object) -> sqlite3.DatabaseError:
    try:
        run()  # type: ignore[operator]
    except sqlite3.DatabaseError as exc:
        return exc
    raise AssertionError("SQLite raised nothing")


def test_sqlites_read_only_refusals_are_read_only_and_other_errors_are_not(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x)")
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    readonly = _error_of(lambda: reader.execute("INSERT INTO t VALUES (1)"))
    assert readonly.sqlite_errorcode & 0xFF == sqlite3.SQLITE_READONLY and _cannot_write(readonly)
    syntax = _error_of(lambda: reader.execute("SELEC 1"))
    assert syntax.sqlite_errorcode == sqlite3.SQLITE_ERROR and not _cannot_write(syntax)
    reader.close()
    missing = _error_of(lambda: sqlite3.connect(f"file:{tmp_path}/no/such/folder.db?mode=rw", uri=True))
    assert missing.sqlite_errorcode == sqlite3.SQLITE_CANTOPEN and _cannot_write(missing)
    writer = sqlite3.connect(path)
    writer.set_authorizer(lambda *args: sqlite3.SQLITE_DENY)
    denied = _error_of(lambda: writer.execute("INSERT INTO t VALUES (1)"))
    assert denied.sqlite_errorcode == sqlite3.SQLITE_AUTH and _cannot_write(denied)
    writer.close()
    damaged = tmp_path / "damaged.db"
    damaged.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4080)
    corrupt = _error_of(lambda: sqlite3.connect(damaged).execute("SELECT * FROM sqlite_master").fetchall())
    assert not _cannot_write(corrupt)
    # An extended code keeps its primary code in the low byte (SQLITE_READONLY_DBMOVED = 8 | 4 << 8).
    moved = sqlite3.OperationalError("attempt to write a readonly database")
    moved.sqlite_errorcode = sqlite3.SQLITE_READONLY | (4 << 8)  # type: ignore[attr-defined]
    assert _cannot_write(moved)
    assert not _cannot_write(sqlite3.DatabaseError("raised by Python, with no SQLite code"))


def test_the_size_reported_is_the_database_and_its_wal(tmp_path: Path) -> None:
    from memwatch.cli.prune import _size

    path = tmp_path / "m.db"
    path.write_bytes(b"x" * 4096)
    assert _size(path) == 4096
    (tmp_path / "m.db-wal").write_bytes(b"w" * 1000)
    (tmp_path / "m.db-shm").write_bytes(b"s" * 32768)  # the shared-memory index is not the database's size
    assert _size(path) == 5096
