"""Opening the store: where it lives, how it is tuned, and how a bad file is reported.

Default path: ``$MEMWATCH_DB``, else ``$XDG_DATA_HOME/memwatch/memwatch.db`` (``~/.local/share``).
Writers use WAL with ``synchronous=NORMAL`` (a crash loses at most the last commit, never the file);
readers open the file read-only (``mode=ro``), so ``memwatch sql`` can never change it, and a database on a
read-only volume, in an archive or in another user's folder can be read as well as a live one
(:func:`readonly_uri`).
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import MemwatchError, NotFoundError, PermissionDeniedError, StoreError, UnavailableError, UsageError
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


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_regular(path: str | os.PathLike[str]) -> None:
    """Refuse a database path that names a FIFO, device, socket or folder, before anything opens it: opening a
    FIFO waits for a writer for good, and a device reads without end. ``stat`` opens nothing; a path that does
    not exist or cannot be looked at passes, for the open to say why."""
    try:
        info = os.stat(path)
    except (FileNotFoundError, PermissionError):
        return
    except OSError as exc:
        raise UsageError(f"the database path {os.fspath(path)!r} cannot be used: {exc.strerror or exc}; "
                         "pass another --db") from None
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        raise UsageError(f"the database {os.fspath(path)} is {kind}, not a file; pass --db (or MEMWATCH_DB) naming "
                         "a memwatch database file")


def readonly_uri(path: str | os.PathLike[str]) -> str:
    """The ``file:`` URI that opens exactly ``path``, read-only: the whole path percent-encoded, so a ``#`` or
    ``?`` in a name is part of the name, not the URI's fragment or query (which would open another file).

    ``mode=ro`` still needs the WAL's ``-shm`` file: SQLite creates it beside the database, or uses the one
    there. In a folder this process cannot write (a read-only mount, an archive, a copy without it) and with no
    ``-shm``, the file is opened ``immutable=1``: no locks and no WAL, which loses nothing when no ``-wal``
    holds writes (a writer in WAL mode always has one open beside the file). The caveat: a writer that starts
    while the file is open that way is not seen. A ``-wal`` with writes but no ``-shm`` in such a folder is
    refused (:class:`PermissionDeniedError`): its writes could not be read, and the answer would be stale.
    """
    from urllib.parse import quote

    uri = f"file://{quote(os.fsencode(os.path.abspath(path)))}?mode=ro"
    if not _needs_immutable(os.fspath(path)):
        return uri
    return f"{uri}&immutable=1"


def _needs_immutable(path: str) -> bool:
    folder = os.path.dirname(os.path.abspath(path))
    if os.access(folder, os.W_OK) or os.path.exists(path + "-shm"):
        return False
    try:
        wal_bytes = os.stat(path + "-wal").st_size
    except FileNotFoundError:
        return True
    except OSError:
        wal_bytes = 1
    if wal_bytes:
        raise PermissionDeniedError(
            f"{path}-wal may hold writes not yet in {path}, and {folder} cannot be written to make the {path}-shm "
            "SQLite needs to read them; copy the database with its -wal (and -shm) to a writable folder and "
            "pass --db there")
    return True


def can_write(db_path: Path) -> bool:
    """Whether this process could write ``db_path`` and the journal files SQLite keeps beside it."""
    return os.access(db_path, os.W_OK) and os.access(db_path.parent, os.W_OK)


def missing_database(db_path: str | os.PathLike[str]) -> NotFoundError:
    """The one message for a database path that names no file, whichever command reads it."""
    return NotFoundError(f"no memwatch database at {os.fspath(db_path)}: run `memwatch serve` (or `memwatch demo`) "
                         "to make one, or pass --db / set MEMWATCH_DB")


_IN_MEMORY: dict[str, Callable[[], sqlite3.Connection]] = {}
"""Databases held in memory under a name that is no file (an incident bundle's ``run.db``), each with what opens
one more read-only connection to it."""


def hold_in_memory(name: str, connect: Callable[[], sqlite3.Connection] | None) -> None:
    """Make ``name`` open through ``connect`` wherever a command opens its ``--db`` to read (``None``: no longer)."""
    if connect is None:
        _IN_MEMORY.pop(name, None)
    else:
        _IN_MEMORY[name] = connect


def held_in_memory(db_path: str | os.PathLike[str]) -> bool:
    """Whether ``db_path`` names a database held in memory (it exists, though no file does)."""
    return os.fspath(db_path) in _IN_MEMORY


def connect_readonly(db_path: Path) -> sqlite3.Connection:
    """A read-only connection to an existing file; a missing or unreadable one is said in one line.

    Nothing is read yet: SQLite opens the file at the first statement, whose error :func:`store_error` words.
    """
    held = _IN_MEMORY.get(os.fspath(db_path))
    if held is not None:
        return held()
    check_regular(db_path)
    if not db_path.exists():
        raise missing_database(db_path)
    if not os.access(db_path, os.R_OK):
        raise PermissionDeniedError(f"cannot read {db_path}: no read permission for uid {os.geteuid()}; "
                                    "check its owner and mode, or copy it somewhere you can read")
    return sqlite3.connect(readonly_uri(db_path), uri=True, check_same_thread=False)


def open_store(
    path: str | os.PathLike[str] | None = None, *, readonly: bool = False, busy_wait: float = 0.0
) -> Database:
    """Open (and for writers create and migrate) the store; errors become one-line :class:`MemwatchError`s.

    A database another process keeps locked is retried, with backoff, for ``busy_wait`` seconds
    beyond SQLite's own 5 s busy timeout.
    """
    db_path = Path(path) if path is not None else default_db_path()
    deadline = time.monotonic() + busy_wait
    delay = 0.1
    while True:
        try:
            return _open(db_path, readonly)
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", None) not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise store_error(db_path, exc, readonly=readonly) from None
            if time.monotonic() >= deadline:
                raise UnavailableError(f"{db_path} is locked by another process ({exc}); stop it or retry later") \
                    from None
            time.sleep(delay)
            delay = min(2 * delay, 1.0)


def _open(db_path: Path, readonly: bool) -> Database:
    try:
        return _connect(db_path, readonly)
    except PermissionError:
        raise PermissionDeniedError(f"no permission to open {db_path}; check its owner and mode") from None
    except OSError as exc:
        raise PermissionDeniedError(f"cannot open {db_path}: {exc.strerror or exc}; check the path, its directory "
                                    "and free space, or pass --db naming a file in a writable directory") from None
    except sqlite3.OperationalError:
        raise
    except sqlite3.DatabaseError as exc:
        raise store_error(db_path, exc, readonly=readonly) from None


def _connect(db_path: Path, readonly: bool) -> Database:
    if readonly:
        conn = connect_readonly(db_path)
    else:
        check_regular(db_path)
        db_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Never open and close the file itself once it exists: closing any descriptor of a file
        # drops the POSIX locks SQLite holds on it in this process.
        if not db_path.exists():
            try:
                os.close(os.open(db_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            except FileExistsError:
                pass
        _check_owner(db_path, os.stat(db_path))
        # The writer keeps a statement per ring and drain shape (memwatch.store.sample_insert): room for hundreds.
        conn = sqlite3.connect(db_path, check_same_thread=False, cached_statements=1024)
    try:
        conn.execute("PRAGMA busy_timeout=5000")
        db = Database(conn)
        if readonly:
            check_schema(db, db_path)
        else:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            migrate(db)
        return db
    except BaseException:
        conn.close()
        raise


def store_error(db_path: Path, exc: sqlite3.DatabaseError, *, readonly: bool = False) -> MemwatchError:
    """SQLite's error on opening ``db_path``, as one line that says what to do."""
    if getattr(exc, "sqlite_errorcode", None) in _CANNOT_WRITE:
        if readonly:
            return PermissionDeniedError(f"cannot open {db_path} to read it ({exc}); check the modes of the file "
                                         "and its folder, or copy the database somewhere you can write")
        folder = db_path.parent
        why = "it is on a read-only file system" if read_only_mount(folder) else str(exc)
        return PermissionDeniedError(
            f"cannot write in {folder}: {why}; the directory must be writable: check its mode and "
            "attributes, or pass --db naming a file in a writable directory"
        )
    return StoreError(f"{db_path} is not a usable memwatch database ({exc}); pass another --db")


def read_only_mount(folder: Path) -> bool:
    """Whether ``folder`` is on a file system mounted read-only (where no mode or owner would help)."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


_CANNOT_WRITE = {sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM, sqlite3.SQLITE_AUTH}


def _check_owner(db_path: Path, info: os.stat_result) -> None:
    """A database another user owns, or others may write, could feed or take this user's records."""
    if info.st_uid != os.getuid():
        raise PermissionDeniedError(f"{db_path} belongs to uid {info.st_uid}, not you; pass a --db of your own")
    if info.st_mode & 0o022:
        raise PermissionDeniedError(
            f"{db_path} is writable by other users (mode {info.st_mode & 0o777:o}); run: chmod 600 {db_path}"
        )


def quick_check(db: Database, db_path: Path) -> None:
    """Refuse to write into a damaged database (``PRAGMA quick_check``); exit 6 rather than make it worse."""
    try:
        result = db.execute("PRAGMA quick_check(1)").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        result = str(exc)
    if result != "ok":
        detail = " ".join(str(result).split())[:200]
        raise StoreError(f"{db_path} is damaged ({detail}); move it aside or pass another --db")


def check_schema(db: Database, db_path: Path) -> None:
    from .schema import SCHEMA_VERSION

    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version == 0:
        raise StoreError(f"{db_path} is not a memwatch database; pass another --db")
    if version > SCHEMA_VERSION:
        raise StoreError(f"{db_path} was written by a newer memwatch (schema {version}); upgrade memwatch")
