"""Rings refused for their owner or mode, removed once nobody writes them, so they do not fill the node's disk.

A ring of an untrusted uid (or one other users may read or write) is never read; it used to stay in the runtime
directory for ever, 8 MiB each on a node's hostPath. The discovery thread now looks at the refused names it
remembers every :data:`SWEEP_EVERY_S` and removes those whose file has not changed for :data:`KEEP_S` and whose
writer no longer holds its lock (a live engine of a uid the operator forgot to trust keeps its ring, and is
named in the log as before). Removal goes through the directory's descriptor and only while the name still
denotes the file judged (:func:`~memwatch_engine.dirfd.unlink_if_same`).

In a sticky shared directory only a file's owner, the directory's owner or a process with ``CAP_FOWNER`` may
remove it: the agent (root, owner of the runtime directory it made) may; a sidecar of another uid may not. Then
the rings stay, the ``memwatch_rings_refused`` gauge and ``/readyz`` keep counting them, and one line says why
they stay and what to do.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable

from memwatch_engine.dirfd import file_id, open_regular, unlink_if_same
from memwatch_engine.liveness import writer_lock_held

from .ring_finder import RingFinder

log = logging.getLogger("memwatch.collector")

KEEP_S = 3600.0
"""A refused ring is removed once its file has not changed for this long (and its writer holds no lock on it)."""
SWEEP_EVERY_S = 300.0
"""How often the refused names are looked at for removal."""
REMOVABLE = frozenset({"untrusted_uid", "mode"})
"""The refusals whose files are removed: regular files nobody will read. (Set-aside rings are moved elsewhere.)"""


class RefusedCleanup:
    """Removes refused rings past :data:`KEEP_S`, every :data:`SWEEP_EVERY_S`; counts what it may not remove."""

    def __init__(self, finder: RingFinder, *, keep_s: float = KEEP_S, every_s: float = SWEEP_EVERY_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._finder = finder
        self.keep_s = keep_s
        self.every_s = every_s
        self._clock = clock
        self._next = clock() + every_s
        self.removed = 0
        """Refused rings removed since the start."""
        self.kept = 0
        """Refused rings past the bound that the last sweep was not permitted to remove."""
        self._said_kept = False

    def tick(self) -> None:
        """Sweep when one is due (called by the discovery thread between its waits)."""
        now = self._clock()
        if now >= self._next:
            self._next = now + self.every_s
            self.sweep()

    def sweep(self) -> int:
        """Remove the refused rings past the bound; returns how many were removed."""
        finder = self._finder
        removed = kept = 0
        for name in finder.refused.names(REMOVABLE):
            outcome = self._remove(name)
            if outcome is True:
                removed += 1
                finder.refused.discard(name)
            elif outcome is False:
                kept += 1
        self.removed += removed
        self.kept = kept
        if removed:
            log.info("removed %d refused ring%s unchanged for %.0f s with no writer", removed,
                     "" if removed == 1 else "s", self.keep_s)
        if kept and not self._said_kept:
            self._said_kept = True
            log.warning("%d refused ring%s cannot be removed from %s: only the directory's owner (or root) may remove "
                        "another user's file there; they stay, counted by memwatch_rings_refused, until their owner "
                        "removes them", kept, "" if kept == 1 else "s", finder.runtime_dir)
        return removed

    def _remove(self, name: str) -> bool | None:
        """True if removed, False if past the bound but not permitted, None if it stays (young, written, gone)."""
        dir_fd = self._finder.dir_fd
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(info.st_mode) or self._clock() - info.st_mtime < self.keep_s:
            return None
        try:
            fd, opened = open_regular(dir_fd, name)  # no symlink followed, no FIFO waited on
        except OSError:
            return None
        try:
            if file_id(opened) != file_id(info) or writer_lock_held(fd):
                return None  # another file now, or its writer still runs
        finally:
            os.close(fd)
        try:
            return unlink_if_same(dir_fd, name, file_id(info)) or None
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
                return False
            return None
