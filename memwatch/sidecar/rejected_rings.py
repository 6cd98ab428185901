"""Rings the sidecar cannot take (a bad header, metadata of the wrong type) moved out of its way, bounded.

A refused ring used to stay in the runtime directory for ever (8 MB each), looked at again by
nobody. It is now moved into ``rejected/`` in the sidecar's own state directory (the runtime
directory itself when that is private; never a directory another uid can write, where ``rejected/``
could be a symlink swapped in under the sidecar), where the newest :data:`MAX_REJECTED` files up to
:data:`MAX_REJECTED_BYTES` in all are kept for a bug report and older ones are removed. Every step goes
through directory descriptors (:mod:`memwatch_engine.dirfd`): the ring is renamed from the runtime
directory's descriptor into ``rejected/``'s, and the folder is bounded through its own descriptor. Where
the state directory is on another file system (a container's two volumes) the ring cannot be renamed:
it stays where it is, refused by name, and its ``set_aside`` row says so. The reason goes to the log and
to the database's ``set_aside`` table, which ``memwatch runs`` reports. Its engine keeps writing into the
moved file (the mapping is unaffected) and nothing reads it: a ring is only refused for what its writer
wrote once and cannot change.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3
import stat
from typing import TYPE_CHECKING, Any

from memwatch_engine.dirfd import file_id, private_subdir

if TYPE_CHECKING:
    from memwatch_engine.ring_reader import RingHeader

    from .log_limit import LogLimiter

log = logging.getLogger("memwatch.collector")

REJECTED_DIR = "rejected"
MAX_REJECTED = 16
"""Refused rings kept in ``rejected/``; the oldest beyond this are removed."""
MAX_REJECTED_BYTES = 256 * 2**20
"""Bytes of refused rings kept in ``rejected/``; the oldest beyond this are removed."""
RING_SET_ASIDE = "ring set aside: "
"""How the reason of a refused ring starts in ``set_aside`` (its ``seq`` is NULL)."""


def set_aside_ring(writer: Any, runtime_fd: int, state_fd: int | None, name: str, ident: tuple[int, int] | None,
                   why: str, header: RingHeader | None, limiter: LogLimiter | None = None) -> bool:
    """Move a refused ring aside and queue its ``set_aside`` row (run and rank when its header could be read).

    ``ident`` is the (device, inode) of the file that was opened and judged: only that file is moved.
    Returns whether it was moved.
    """
    from ..store.writer import Batch, WriterStalled  # the sidecar's path; ``memwatch runs`` does not pay for it

    where = move_aside(runtime_fd, state_fd, name, ident)
    line = f"ignoring ring {name}: {why}; {where}"
    if limiter is not None:
        limiter.warning("ring set aside", "%s", line)
    else:
        log.warning("%s", line)
    run_id, rank = (header.run_id, header.rank) if header is not None else (None, None)
    raw = json.dumps(header.meta).encode() if header is not None else b""
    try:
        writer.submit(Batch(set_aside=[(run_id, rank, None, None, f"{RING_SET_ASIDE}{name}: {why}; {where}", raw)]))
    except WriterStalled:
        pass  # the log line says it
    return where.startswith("moved")


def move_aside(runtime_fd: int, state_fd: int | None, name: str, ident: tuple[int, int] | None) -> str:
    """Rename the refused ring ``name`` into ``rejected/`` and keep that folder bounded; says where it went."""
    if state_fd is None or ident is None:
        return "not moved: the sidecar has no state directory of its own to keep it in"
    try:
        folder = private_subdir(state_fd, REJECTED_DIR)  # created 0700, checked to be ours alone
    except OSError as exc:
        return f"not moved: {REJECTED_DIR}/ cannot be used ({exc.strerror or exc})"
    try:
        try:
            now = os.stat(name, dir_fd=runtime_fd, follow_symlinks=False)
        except OSError as exc:
            return f"not moved: {exc.strerror or exc}"
        if file_id(now) != ident:
            return "not moved: its name denotes another file now"
        try:
            os.rename(name, name, src_dir_fd=runtime_fd, dst_dir_fd=folder)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                return ("not moved: the state directory is on another file system; it stays in the runtime "
                        "directory and is not read again")
            return f"not moved: {exc.strerror or exc}"
        _undo_swap(folder, name, ident)
        _bound(folder)
    finally:
        os.close(folder)
    return f"moved to {REJECTED_DIR}/{name}"


def _undo_swap(folder: int, name: str, ident: tuple[int, int]) -> None:
    """Drop what a writer swapped in between our look and the rename: only the ring judged is kept."""
    try:
        moved = os.stat(name, dir_fd=folder, follow_symlinks=False)
        if file_id(moved) != ident and not stat.S_ISDIR(moved.st_mode):
            os.unlink(name, dir_fd=folder)
    except OSError:
        pass


def _bound(folder: int) -> None:
    """Remove the oldest refused rings beyond :data:`MAX_REJECTED` files or :data:`MAX_REJECTED_BYTES`."""
    entries = []
    with os.scandir(folder) as listing:
        for entry in listing:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(info.st_mode):
                entries.append((info.st_mtime_ns, info.st_size, entry.name))
    entries.sort(reverse=True)
    total = 0
    for kept, (_mtime, size, name) in enumerate(entries, 1):
        total += size
        if kept > MAX_REJECTED or total > MAX_REJECTED_BYTES:
            try:
                os.unlink(name, dir_fd=folder)
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
