"""Finding and opening rings in a runtime directory another uid may write: the collector's hostile-ground half.

Everything goes through a descriptor of the runtime directory (:mod:`memwatch_engine.dirfd`): a name is
judged by ``lstat`` first (a refusal opens nothing), opened without following a symlink or waiting on a FIFO,
and what was opened is judged again by ``fstat`` — a FIFO swapped in between is refused, never waited on. A
stored ring is removed only while its name still denotes the file that was read.

Another uid may fill the directory with names, so the looking is done off the sidecar's loop, by the discovery
thread (:mod:`.discovery`: a listing once, then the names the kernel reports, each judged by :meth:`judge`), and
its cost stays bounded where the directory must be scanned: an unchanged directory is not listed again (but
every :data:`FULL_SCAN_S`), a scan that took long is followed by the next only :data:`SCAN_PAUSE` times as long
later, refused names are remembered up to a bound (:mod:`.refused_names`), and the lines logged about them are
limited (:mod:`.log_limit`).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from memwatch_engine.dirfd import open_dir, open_regular, reopen_dir, unlink_if_same
from memwatch_engine.runtime import RING_SUFFIX, is_shared_dir, judge_ring, trusted_uids

from .log_limit import LogLimiter
from .refused_names import RefusedNames

log = logging.getLogger("memwatch.collector")

FULL_SCAN_S = 30.0
"""A directory whose modification time has not changed is listed again only this often."""
QUIET_DIR_NS = 2 * 10**9
"""A modification time at least this old when read is trusted to change with the next change (its clock ticks
coarsely: two changes within one tick may share a time)."""
SCAN_PAUSE = 4
"""A scan that took T seconds (a directory flooded with names) is followed by the next no sooner than 4 T later."""
SLOW_SCAN_S = 0.05
LISTING_SLICE = 1024
"""A listing lets other work in every this many names (about a millisecond of listing, a few with ``lstat``)."""


def refusal_reason(info: os.stat_result, trusted: frozenset[int]) -> str:
    """The fixed reason (:data:`~.refused_names.REASONS`) for what :func:`judge_ring` refused, in its order."""
    if not stat.S_ISREG(info.st_mode):
        return "not_regular"
    if info.st_uid != os.getuid() and info.st_uid not in trusted:
        return "untrusted_uid"
    return "mode"


class RingFinder:
    """The runtime directory's descriptor (and the state directory's), and the names refused in it."""

    def __init__(self, runtime_dir: Path, *, trust: Iterable[int] = (), runtime_fd: int | None = None,
                 state_fd: int | None = None) -> None:
        """``runtime_fd``/``state_fd`` are copied; by default the runtime directory is opened, and is the state
        directory too when it is ours alone. Without a state directory a refused ring is only refused by name."""
        self.runtime_dir = runtime_dir
        self.dir_fd = os.dup(runtime_fd) if runtime_fd is not None else open_dir(runtime_dir)
        info = os.fstat(self.dir_fd)
        private = not is_shared_dir(info) and info.st_uid == os.getuid() and not info.st_mode & 0o077
        self.state_fd = os.dup(state_fd) if state_fd is not None else os.dup(self.dir_fd) if private else None
        self.trusted = trusted_uids(trust)
        """Uids whose rings are stored besides our own (``trust`` and ``$MEMWATCH_TRUST_UIDS``)."""
        self.refused = RefusedNames()
        self._uids_said = RefusedNames(limit=1024)
        """Untrusted uids already named in the log (bounded, like the names)."""
        self.limited = LogLimiter(log)
        self._listed_mtime: int | None = None
        self._next_full_scan = 0.0
        self._not_before = 0.0

    def candidates(self, between: Callable[[], None] | None = None) -> Iterator[str]:
        """The names of regular files that look like trusted rings (by ``lstat``), when a scan is due
        (``between``: as for :meth:`listing`)."""
        self.limited.flush()
        began = time.monotonic()
        if began < self._not_before:
            return
        try:
            mtime = os.fstat(self.dir_fd).st_mtime_ns
        except OSError as exc:
            log.error("cannot look at %s: %s", self.runtime_dir, exc)
            return
        if mtime == self._listed_mtime and began < self._next_full_scan:
            return
        wall = time.time_ns()
        yield from self.listing(between)
        took = time.monotonic() - began
        self._listed_mtime = mtime if wall - mtime >= QUIET_DIR_NS else None
        self._next_full_scan = began + FULL_SCAN_S
        self._not_before = began + took * (1 + SCAN_PAUSE) if took > SLOW_SCAN_S else 0.0

    def listing(self, between: Callable[[], None] | None = None) -> Iterator[str]:
        """Every name a complete listing shows that looks like a trusted ring (names refused already are not
        looked at again); ``between`` is called every :data:`LISTING_SLICE` names, so that a listing of a
        flooded directory can let other work in (the changes the kernel reported meanwhile)."""
        if self.dir_fd < 0:  # closed (a thread released after the sidecar's close): os.scandir(-1) lists the cwd
            return
        before = self.refused.generation
        still_there: set[str] = set()
        try:
            fd = reopen_dir(self.dir_fd)  # the stop's last look may list the folder while this thread does
        except OSError as exc:
            log.error("cannot list %s: %s", self.runtime_dir, exc)
            return
        try:
            with os.scandir(fd) as listing:
                for seen, entry in enumerate(listing, 1):
                    if between is not None and not seen % LISTING_SLICE:
                        between()
                    name = entry.name
                    if not name.endswith(RING_SUFFIX):
                        continue
                    if name in self.refused:
                        still_there.add(name)
                    elif self._looks_trusted(entry):
                        yield name
        except OSError as exc:
            log.error("cannot list %s: %s", self.runtime_dir, exc)
            return
        finally:
            os.close(fd)
        self.refused.forget_unlisted(still_there, before)  # refused now, not ever

    def judge(self, name: str) -> bool:
        """Whether the entry ``name`` looks like a trusted ring now (by ``lstat``); refused (and remembered) if not."""
        if not name.endswith(RING_SUFFIX) or os.sep in name:
            return False
        self.refused.discard(name)  # a name that changed (created again, another owner or mode) is judged afresh
        try:
            info = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self.refuse(name, exc.strerror or str(exc))
            return False
        return self._judged(name, info)

    def _looks_trusted(self, entry: os.DirEntry[str]) -> bool:
        name = entry.name
        try:
            info = entry.stat(follow_symlinks=False)  # an lstat relative to the directory's descriptor
        except FileNotFoundError:
            return False
        except OSError as exc:
            self.refuse(name, exc.strerror or str(exc))
            return False
        return self._judged(name, info)

    def _judged(self, name: str, info: os.stat_result) -> bool:
        why = judge_ring(info, self.trusted)
        if why:
            self.refuse(name, why, refusal_reason(info, self.trusted), info.st_uid)
        return not why

    def open(self, name: str) -> tuple[int, os.stat_result] | None:
        """Open ``name`` by the directory's descriptor and judge what was opened; None (and refused) if not a ring."""
        try:
            fd, info = open_regular(self.dir_fd, name)
        except OSError as exc:
            self.refuse(name, exc.strerror or str(exc))
            return None
        why = judge_ring(info, self.trusted)
        if why:
            os.close(fd)
            self.refuse(name, why, refusal_reason(info, self.trusted), info.st_uid)
            return None
        return fd, info

    def refuse(self, name: str, why: str, reason: str = "unreadable", uid: int | None = None) -> None:
        """Remember the name (bounded) under ``reason`` (:data:`~.refused_names.REASONS`) and say why, within
        the log's limit: for an untrusted uid, one line per uid (its first ring), the rest only counted."""
        self.refused.add(name, reason)
        if reason == "untrusted_uid" and uid is not None:
            if str(uid) in self._uids_said:
                return
            self._uids_said.add(str(uid))
        self.limited.warning("ring ignored", "ignoring ring %s/%s: %s", self.runtime_dir, name, why)

    def unlink(self, name: str, ident: tuple[int, int]) -> bool:
        """Remove a stored ring while its name still denotes the file read; False (one log line) where we may not."""
        try:
            unlink_if_same(self.dir_fd, name, ident)
        except OSError as exc:  # a shared sticky directory: only the ring's writer or the directory's owner may
            self.limited.warning(
                "ring not removed", "cannot remove the stored ring %s: %s; run the sidecar as the runtime "
                "directory's owner (or root) so that it can", self.runtime_dir / name, exc.strerror or exc)
            return False
        return True

    def close(self) -> None:
        self.limited.flush(all_windows=True)
        for fd in (self.dir_fd, self.state_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.dir_fd, self.state_fd = -1, None
