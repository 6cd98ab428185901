"""The sidecar's side of ``MEMWATCH_OOM_SNAPSHOT=1``: the snapshot an OOM wrote is imported by itself.

The engine's OOM observer dumps PyTorch's snapshot and names the file in its ``oom`` event. This
observer of the collector sees that event and imports the file on a worker thread (a snapshot can
be large; the rings keep draining meanwhile), submitting the events to the single writer. It only
reads a file that is a regular file owned by this user and not writable by others, with the same
restricted loader as ``memwatch import-snapshot``; a file it cannot use is logged, never fatal.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memwatch.errors import MemwatchError
from memwatch.records import Event, Sample
from memwatch.snapshot.importer import snapshot_events
from memwatch.snapshot.reader import read_snapshot
from memwatch.store.writer import Batch, StoreWriter
from memwatch_engine.ring_reader import RingHeader

log = logging.getLogger("memwatch.snapshot")

JOIN_TIMEOUT_S = 30.0


def trusted_snapshot(path: Path) -> str | None:
    """Why the sidecar must not read ``path``, or ``None`` when it may."""
    try:
        info = os.stat(path)
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
        self.imported = 0

    def __call__(self, header: RingHeader, records: list[Sample | Event]) -> list[tuple[Any, ...]]:
        for record in records:
            if type(record) is Event and record.kind == "oom":
                path = record.data.get("snapshot_path")
                if isinstance(path, str) and path and path not in self._seen:
                    self._seen.add(path)
                    thread = threading.Thread(target=self._import, args=(Path(path), record),
                                              name="memwatch-snapshot-import", daemon=True)
                    self._threads.append(thread)
                    thread.start()
        return []

    def _import(self, path: Path, oom: Event) -> None:
        why = trusted_snapshot(path)
        if why is not None:
            log.warning("not importing the memory snapshot %s: %s", path, why)
            return
        try:
            snapshot, sha256 = read_snapshot(path)
            reader = self._open_reader()
            try:
                new = snapshot_events(reader, oom.run_id, oom.rank, snapshot, path=str(path), sha256=sha256,
                                      oom_event=oom)
            finally:
                reader.conn.close()
            self._writer.submit(Batch(events=[event.to_row() for event in new]))
            self.imported += 1
            log.warning("run %s rank %d: imported the memory snapshot %s (%d events)", oom.run_id, oom.rank, path,
                        len(new))
        except MemwatchError as exc:
            log.warning("could not import the memory snapshot %s: %s", path, exc)
        except Exception as exc:  # a broken file must never take the sidecar down
            log.error("could not import the memory snapshot %s: %s: %s", path, type(exc).__name__, exc)

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Wait (bounded) for imports in progress, so their events reach the writer before it closes."""
        for thread in self._threads:
            thread.join(timeout)
        self._threads.clear()
