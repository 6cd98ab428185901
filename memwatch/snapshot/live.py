"""The sidecar's side of ``MEMWATCH_OOM_SNAPSHOT=1``: the snapshot an OOM wrote is imported by itself.

The engine's OOM observer dumps PyTorch's snapshot beside the database (the directory of
``$MEMWATCH_DB``) as ``oom-<run>-r<rank>-<pid>.pickle`` and names the file in its ``oom`` event. This
observer of the collector sees that event and imports the file on one worker thread (the rings keep
draining meanwhile), submitting the events to the single writer.

The path comes from another process, and the sidecar may run as root, so the path is only a name to
look for, never a path to follow. Normalised (``/./``, ``//``, ``..``), it must name a file directly
in the directory of the database this sidecar writes, named as the engine names the snapshot of that
ring's run and rank; the file is opened through a descriptor of that directory with ``O_NOFOLLOW``
and ``O_NONBLOCK`` and judged by ``fstat`` of the open descriptor: a regular file owned by the uid that
wrote the ring (not the sidecar's), writable by no one else, of at most 256 MiB. It is parsed through
:mod:`.untrusted` (a child process with CPU, memory and wall-time limits, as that uid). One file is
read at a time; at most :data:`MAX_WAITING` wait; a file (device and inode) is read once, however
it is spelled or linked. A file it cannot use becomes one ``snapshot_failed`` event (``{"path",
"reason"}``) on the rank, and a path the run already has an import or a failure for is never read
again, so a sidecar that restarts and sees the event once more does not retry it.
"""

from __future__ import annotations

import logging
import os
import posixpath
import queue
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from memwatch.errors import MemwatchError, UsageError
from memwatch.records import Event, Sample
from memwatch.sidecar.log_limit import LogLimiter
from memwatch.snapshot.importer import snapshot_events
from memwatch.snapshot.reader import MemorySnapshot
from memwatch.snapshot.untrusted import DEFAULT_LIMITS, Limits, checked, open_snapshot, read_open, stop_readers
from memwatch.store.writer import Batch, StoreWriter
from memwatch_engine.ring_reader import RingHeader

log = logging.getLogger("memwatch.snapshot")

JOIN_TIMEOUT_S = 10.0
MAX_PATH = 4096
"""Characters a snapshot path in an event may have."""
MAX_WAITING = 16
"""Snapshots waiting for the worker; one more is refused (a ``snapshot_failed`` event), not queued."""
MAX_REMEMBERED = 1024
"""Paths and files remembered as already taken, the oldest forgotten first."""
DONE_KINDS = ("snapshot_imported", "snapshot_failed")
_ENGINE_NAME = re.compile(r"oom-(?P<run>.+)-r(?P<rank>[0-9]+)-[0-9]{1,10}\.pickle")


class _Recent:
    """A set that remembers at most ``size`` keys: the oldest go first."""

    def __init__(self, size: int = MAX_REMEMBERED) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self._size = size

    def add(self, key: Hashable) -> bool:
        """True when ``key`` is new (and now remembered)."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return False
        self._keys[key] = None
        if len(self._keys) > self._size:
            self._keys.popitem(last=False)
        return True


def normal_path(path: str) -> str:
    """``path`` with ``/./``, ``//`` and ``..`` resolved by the text alone (nothing on disk is looked at)."""
    normal = posixpath.normpath(path)
    return "/" + normal.lstrip("/") if normal.startswith("/") else normal


def misplaced(path: str, directory: Path, run_id: str, rank: int) -> str | None:
    """Why the normalised ``path`` is not where the engine writes the snapshot of ``run_id``'s ``rank``, or None."""
    if not path.startswith("/"):
        return "not an absolute path"
    parent, name = posixpath.split(path)
    places = {normal_path(str(directory.absolute())), os.path.realpath(directory)}
    if parent not in places:
        return f"not in {directory}, where snapshots are written (beside the database)"
    named = _ENGINE_NAME.fullmatch(name)
    if named is None or named["run"] != run_id or int(named["rank"]) != rank:
        return f"not named oom-{run_id}-r{rank}-PID.pickle, as the engine names this ring's snapshot"
    return None


class SnapshotImporter:
    """Collector observer: imports the snapshot an ``oom`` event names; stores no flags itself."""

    events_only = True
    """The collector hands it a drain's events alone: it never looks at a sample (and typing them costs)."""

    def __init__(self, writer: StoreWriter, open_reader: Callable[[], Any], *, directory: Path | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        """``directory`` is where snapshots may be: by default the directory of the database ``open_reader`` opens."""
        self._writer = writer
        self._open_reader = open_reader
        self._directory = directory
        self._limits = limits
        self._waiting: queue.Queue[tuple[str, Event, int | None]] = queue.Queue(MAX_WAITING)
        self._worker: threading.Thread | None = None
        self._seen = _Recent()
        self._files = _Recent()
        self._log = LogLimiter(log)
        self._stopping = threading.Event()
        self.imported = 0
        self.failed = 0
        self.skipped = 0

    def __call__(self, header: RingHeader, records: list[Sample | Event]) -> list[tuple[Any, ...]]:
        for record in records:
            if type(record) is not Event or record.kind != "oom" or self._stopping.is_set():
                continue
            path = record.data.get("snapshot_path")
            if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH or "\0" in path:
                continue
            path = normal_path(path)
            if not self._seen.add(path):
                self.skipped += 1
                self._log.warning("snapshot-again", "the memory snapshot %s was named again; not read again", path)
                continue
            try:
                self._waiting.put_nowait((path, record, getattr(header, "owner_uid", None)))
            except queue.Full:
                self._failed(path, record, f"{MAX_WAITING} other snapshots were waiting to be imported; import it "
                                           "with memwatch import-snapshot")
                continue
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="memwatch-snapshot-import", daemon=True)
                self._worker.start()
        return []

    def _work(self) -> None:
        while not self._stopping.is_set():
            try:
                path, oom, owner = self._waiting.get(timeout=0.2)
            except queue.Empty:
                continue
            self._import(path, oom, owner)

    def _import(self, path: str, oom: Event, owner: int | None) -> None:
        try:
            reader = self._open_reader()
            try:
                if _already_tried(reader, oom.run_id, path):
                    self.skipped += 1
                    self._log.warning("snapshot-again", "the memory snapshot %s was imported or refused before; "
                                      "not read again", path)
                    return
                directory = self._directory if self._directory is not None else _database_directory(reader)
                read = self._read(path, directory, oom, owner)
                if read is None:
                    return
                snapshot, sha256 = read
                new = snapshot_events(reader, oom.run_id, oom.rank, snapshot, path=path, sha256=sha256,
                                      oom_event=oom)
            finally:
                reader.conn.close()
            self._writer.submit(Batch(events=[event.to_row() for event in new]))
            self.imported += 1
            log.warning("run %s rank %d: imported the memory snapshot %s (%d events)", oom.run_id, oom.rank, path,
                        len(new))
        except MemwatchError as exc:
            self._failed(path, oom, str(exc))
        except Exception as exc:  # a broken file must never take the sidecar down
            self._failed(path, oom, f"{type(exc).__name__} while importing it")

    def _read(self, path: str, directory: Path, oom: Event, owner: int | None) -> tuple[MemorySnapshot, str] | None:
        """The snapshot and its SHA-256; None for a file already read under another name. Refusals raise."""
        why = misplaced(path, directory, oom.run_id, oom.rank)
        if why is not None:
            raise UsageError(f"{path} is {why}")
        if owner is None:
            raise UsageError(f"{path} is not read: the uid that wrote the ring is unknown")
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = open_snapshot(Path(posixpath.basename(path)), dir_fd=dir_fd, shown=path)
        finally:
            os.close(dir_fd)
        try:
            info = checked(fd, path, self._limits.size_bytes)
            if info.st_uid != owner:
                raise UsageError(f"{path}: owned by uid {info.st_uid}, not by uid {owner}, which wrote the ring")
            if info.st_mode & 0o022:
                raise UsageError(f"{path}: mode {stat.S_IMODE(info.st_mode):o} lets other users write it")
            if not self._files.add((info.st_dev, info.st_ino)):
                self.skipped += 1
                self._log.warning("snapshot-again", "%s is a memory snapshot already read under another name; not "
                                  "read again", path)
                return None
            return read_open(fd, info, path, self._limits)
        finally:
            os.close(fd)

    def _failed(self, path: str, oom: Event, reason: str) -> None:
        if self._stopping.is_set():
            log.warning("the import of the memory snapshot %s was stopped with the sidecar", path)
            return
        self.failed += 1
        self._log.warning("snapshot-failed", "could not import the memory snapshot %s: %s", path, reason)
        failed = Event(oom.run_id, oom.rank, oom.step, oom.ts_ns, "snapshot_failed", {"path": path, "reason": reason})
        self._writer.submit(Batch(events=[failed.to_row()]))

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Stop: the reading child is killed, the worker joined (bounded); an import cut short records no failure."""
        self._stopping.set()
        stop_readers()
        if self._worker is not None:
            self._worker.join(timeout)
        dropped = self._waiting.qsize()
        if dropped:
            log.warning("%d memory snapshots still waiting were not imported (the sidecar stopped); import "
                        "them with memwatch import-snapshot", dropped)
        self._log.flush()


def _database_directory(db: Any) -> Path:
    for _, name, file in db.execute("PRAGMA database_list").fetchall():
        if name == "main" and file:
            return Path(file).parent
    raise UsageError("the database is not a file, so no snapshot lies beside it")


def _already_tried(db: Any, run_id: str, path: str) -> bool:
    row = db.execute(f"SELECT 1 FROM events WHERE run_id = ? AND kind IN ({', '.join('?' * len(DONE_KINDS))}) "
                     "AND CASE WHEN json_valid(data) THEN json_extract(data, '$.path') END = ? LIMIT 1",
                     (run_id, *DONE_KINDS, path)).fetchone()
    return row is not None
