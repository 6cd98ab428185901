"""Rings the sidecar cannot take (a bad header, metadata of the wrong type) moved out of its way, bounded.

A refused ring used to stay in the runtime directory for ever (8 MB each), looked at again by
nobody. It is now moved into ``rejected/`` under the runtime directory, where the newest
:data:`MAX_REJECTED` files up to :data:`MAX_REJECTED_BYTES` in all are kept for a bug report and
older ones are removed; the reason goes to the log and to the database's ``set_aside`` table, which
``memwatch runs`` reports. Its engine keeps writing into the moved file (the mapping is unaffected)
and nothing reads it: a ring is only refused for what its writer wrote once and cannot change.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memwatch_engine.ring_reader import RingHeader

log = logging.getLogger("memwatch.collector")

REJECTED_DIR = "rejected"
MAX_REJECTED = 16
"""Refused rings kept in ``rejected/``; the oldest beyond this are removed."""
MAX_REJECTED_BYTES = 256 * 2**20
"""Bytes of refused rings kept in ``rejected/``; the oldest beyond this are removed."""
RING_SET_ASIDE = "ring set aside: "
"""How the reason of a refused ring starts in ``set_aside`` (its ``seq`` is NULL)."""


def set_aside_ring(writer: Any, runtime_dir: Path, path: Path, why: str, header: RingHeader | None) -> None:
    """Move a refused ring aside and queue its ``set_aside`` row (run and rank when its header could be read)."""
    from .store.writer import Batch, WriterStalled  # the sidecar's path; ``memwatch runs`` does not pay for it

    moved = move_aside(path, runtime_dir, why)
    where = f"; moved to {REJECTED_DIR}/{path.name}" if moved else ""
    run_id, rank = (header.run_id, header.rank) if header is not None else (None, None)
    raw = json.dumps(header.meta).encode() if header is not None else b""
    try:
        writer.submit(Batch(set_aside=[(run_id, rank, None, None, f"{RING_SET_ASIDE}{path.name}: {why}{where}", raw)]))
    except WriterStalled:
        pass  # the log line says it


def move_aside(path: Path, runtime_dir: Path, why: str) -> Path | None:
    """Move the refused ring ``path`` into ``rejected/``, keep that folder bounded; where it went, or None."""
    folder = runtime_dir / REJECTED_DIR
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        if folder.is_symlink() or not folder.is_dir():
            raise OSError(f"{folder} is not a directory")
        target = folder / path.name
        os.replace(path, target)
    except OSError as exc:
        log.warning("ignoring ring %s: %s (it could not be moved aside: %s)", path, why, exc)
        return None
    log.warning("ignoring ring %s: %s; moved to %s", path.name, why, target)
    _bound(folder)
    return target


def _bound(folder: Path) -> None:
    """Remove the oldest refused rings beyond :data:`MAX_REJECTED` files or :data:`MAX_REJECTED_BYTES`."""
    entries = []
    for entry in os.scandir(folder):
        try:
            stat = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        entries.append((stat.st_mtime_ns, stat.st_size, entry.path))
    entries.sort(reverse=True)
    total = 0
    for kept, (_mtime, size, path) in enumerate(entries, 1):
        total += size
        if kept > MAX_REJECTED or total > MAX_REJECTED_BYTES:
            try:
                os.unlink(path)
            except OSError:
                pass


def set_aside_notes(db: Any) -> list[str]:
    """Lines for ``memwatch runs``: rings and records the sidecar refused, so nothing is missing silently."""
    try:
        rings = db.execute("SELECT count(*), max(reason) FILTER (WHERE rowid = (SELECT max(rowid) FROM set_aside"
                           " WHERE seq IS NULL)) FROM set_aside WHERE seq IS NULL").fetchone()
        records = db.execute("SELECT count(*) FROM set_aside WHERE seq IS NOT NULL").fetchone()[0]
    except sqlite3.Error:
        return []
    lines = []
    if rings[0]:
        lines.append(f"note: {rings[0]} ring{'s were' if rings[0] > 1 else ' was'} refused and not read (the last: "
                     f"{str(rings[1]).removeprefix(RING_SET_ASIDE)}); "
                     "`memwatch sql \"SELECT * FROM set_aside WHERE seq IS NULL\"` lists them")
    if records:
        lines.append(f"note: {records} record{'s' if records > 1 else ''} could not be taken and were set aside; "
                     "`memwatch sql \"SELECT run_id, rank, seq, reason FROM set_aside\"` lists them")
    return lines
