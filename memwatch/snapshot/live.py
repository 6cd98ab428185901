"""The sidecar's side of ``MEMWATCH_OOM_SNAPSHOT=1``: the snapshot an OOM wrote is imported by itself.

The engine's OOM observer dumps PyTorch's snapshot and names the file in its ``oom`` event. This
observer of the collector sees that event and imports the file on a worker thread (the rings keep
draining meanwhile), submitting the events to the single writer. It only reads a regular file owned
by this user and not writable by others, through :mod:`.untrusted` (a child process with CPU, memory
and wall-time limits). A file it cannot use becomes one ``snapshot_failed`` event (``{"path",
"reason"}``) on the rank, and a file the run already has an import or a failure for is never read
again, so a sidecar that restarts and sees the event once more does not retry it.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memwatch.errors import MemwatchError, UsageError
from memwatch.records import Event, Sample
from memwatch.snapshot.importer import snapshot_events
from memwatch.snapshot.untrusted import read_snapshot, stop_readers
from memwatch.store.writer import Batch, StoreWriter
from memwatch_engine.ring_reader import RingHeader

log = logging.getLogger("memwatch.snapshot")

JOIN_TIMEOUT_S = 10.0
MAX_PATH = 4096
"""Characters a snapshot path in an event may have."""
DONE_KINDS = ("snapshot_imported", "snapshot_failed")


def trusted_snapshot(path: Path) -> str | None:
    """Why the sidecar must not read ``path``, or ``None`` when it may."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return exc.strerror or "unreadable"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}, not by this user"
    if info.st_mode & 0o022:
        return f"mode {info.st_mode & 0o777:o} lets other users write it"
    return None


class SnapshotImporter:
    """Collector observer: imports the snapshot an ``oom`` event names; stores no flags itself."""

    events_only = True
    """The collector hands it a drain's events alone: it never looks at a sample (and typing them costs)."""

    def __init__(self, writer: StoreWriter, open_reader: Callable[[], Any]) -> None:
        self._writer = writer
        self._open_reader = open_reader
        self._threads: list[threading.Thread] = []
        self._seen: set[str] = set()
        self._stopping = False
        self.imported = 0
        self.failed = 0
        self.skipped = 0

    def __call__(self, header: RingHeader, records: list[Sample | Event]) -> list[tuple[Any, ...]]:
        for record in records:
            if type(record) is Event and record.kind == "oom" and not self._stopping:
                path = record.data.get("snapshot_path")
                if isinstance(path, str) and 0 < len(path) <= MAX_PATH and "\0" not in path and path not in self._seen:
                    self._seen.add(path)
                    thread = threading.Thread(target=self._import, args=(Path(path), record),
                                              name="memwatch-snapshot-import", daemon=True)
                    self._threads.append(thread)
                    thread.start()
        return []

    def _import(self, path: Path, oom: Event) -> None:
        try:
            reader = self._open_reader()
            try:
                if _already_tried(reader, oom.run_id, str(path)):
                    self.skipped += 1
                    log.warning("the memory snapshot %s was imported or refused before; not read again", path)
                    return
                why = trusted_snapshot(path)
                if why is not None:
                    raise UsageError(f"{path} is {why}" if why.startswith("not ") else f"{path}: {why}")
                snapshot, sha256 = read_snapshot(path)
                new = snapshot_events(reader, oom.run_id, oom.rank, snapshot, path=str(path), sha256=sha256,
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

    def _failed(self, path: Path, oom: Event, reason: str) -> None:
        if self._stopping:
            log.warning("the import of the memory snapshot %s was stopped with the sidecar", path)
            return
        self.failed += 1
        log.warning("could not import the memory snapshot %s: %s", path, reason)
        failed = Event(oom.run_id, oom.rank, oom.step, oom.ts_ns, "snapshot_failed", {"path": str(path),
                                                                                        "reason": reason})
        self._writer.submit(Batch(events=[failed.to_row()]))

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Stop: reading children are killed, threads joined (bounded); an import cut short records no failure."""
        self._stopping = True
        stop_readers()
        for thread in self._threads:
            thread.join(timeout)
        self._threads.clear()


def _already_tried(db: Any, run_id: str, path: str) -> bool:
    rows = db.execute(f"SELECT data FROM events WHERE run_id = ? AND kind IN ({', '.join('?' * len(DONE_KINDS))})",
                      (run_id, *DONE_KINDS)).fetchall()
    for (data,) in rows:
        try:
            if json.loads(data or "{}").get("path") == path:
                return True
        except (ValueError, AttributeError):
            continue
    return False
