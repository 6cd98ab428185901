"""The local spool of incident bundles waiting to be shipped: ``bundles/`` in the sidecar's private state directory.

A finished bundle is moved (renamed, or copied where the spool is on another file system) into the spool before
anything is uploaded, so a store that is down, a sidecar that is killed or a node that reboots with its state
volume loses nothing: the next sidecar finds the bundle there and ships it. The spool is a directory of the
sidecar's user, mode 0700, opened once and used only through its descriptor (``openat``, ``renameat``,
``unlinkat``), like the sidecar's other files. A copy is written as ``.<name>.tmp`` and renamed into place once
complete, so the shipper only ever sees whole bundles; leftovers of a copy cut short are removed at start.

Once uploaded, a bundle is deleted from the spool (delete after success); the upload itself is put-if-absent
(:func:`memwatch.incident.objstore.put`), so a sidecar killed between the two ships it again as "already there",
never as a second copy.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from memwatch_engine.dirfd import (
    create_exclusive,
    file_id,
    list_names,
    open_dir,
    open_regular,
    private_subdir,
    unlink_if_same,
)

from ..errors import PermissionDeniedError, UsageError

log = logging.getLogger("memwatch.incident")

SPOOL_NAME = "bundles"
BUNDLE_NAME = re.compile(r"memwatch-incident-[A-Za-z0-9._-]{1,200}\.tar\.gz")
"""What a bundle's file name looks like (``memwatch-incident-<utc>-<pod or host>-<run>.tar.gz``); nothing else is
spooled or shipped."""
COPY_CHUNK = 1 << 20
CAP_BYTES = 256 * 1024 * 1024
CAP_COUNT = 64
"""The spool's default cap: 256 MiB and 64 bundles. In the chart's sidecar the spool shares the database's 2 GiB
``emptyDir`` with a database bounded at 1.55 GB; ``docs/incidents.md`` has the arithmetic."""

_active_lock = threading.Lock()
_active: Spool | None = None


class Spool:
    """The spool directory, open: bundles in, names out (oldest first), deleted once shipped."""

    def __init__(self, state_fd: int, shown: Path, on_enqueue: Callable[[], None] | None = None, *,
                 cap_bytes: int = CAP_BYTES, cap_count: int = CAP_COUNT) -> None:
        self.on_enqueue = on_enqueue
        """Called after each bundle is spooled (the shipper's wake-up)."""
        self.on_drop: Callable[[str, int, str], None] | None = None
        """Told of each bundle dropped to keep the spool within its cap: (name, bytes, why)."""
        self.cap_bytes, self.cap_count = cap_bytes, cap_count
        self.dropped = 0
        self.path = shown / SPOOL_NAME
        try:
            self.fd = private_subdir(state_fd, SPOOL_NAME, shown=self.path)
        except OSError as exc:
            raise PermissionDeniedError(f"cannot use {self.path} as the bundle spool: {exc.strerror or exc}; it must "
                                        "be a directory of the sidecar's user, mode 0700") from None
        self._remove_partial_copies()

    def _names(self) -> list[str]:
        """The spool's names (the shipper, a build and ``/readyz`` list it from their own threads); none once it is
        closed."""
        return list_names(self.fd) if self.fd >= 0 else []

    def _remove_partial_copies(self) -> None:
        for name in self._names():
            if name.startswith(".") and name.endswith(".tmp"):
                try:
                    os.unlink(name, dir_fd=self.fd)
                    log.info("bundle spool: removed %s, a copy cut short", name)
                except OSError:
                    pass

    def enqueue(self, path: Path) -> None:
        """Move the finished bundle at ``path`` into the spool (:meth:`enqueue_from` its folder's descriptor)."""
        path = Path(path)
        dir_fd = open_dir(path.parent)
        try:
            self.enqueue_from(dir_fd, path.name)
        finally:
            os.close(dir_fd)

    def enqueue_from(self, src_fd: int, name: str) -> None:
        """Move the finished bundle ``name`` of the folder ``src_fd`` into the spool (a rename, or on another file
        system a copy then a rename), then wake the shipper. The source is removed once the spool holds it whole.

        By descriptors only, never following a link: what is moved or copied is a regular file judged by ``fstat``
        (a name swapped for a link to another file is refused, never copied)."""
        if not BUNDLE_NAME.fullmatch(name):
            raise UsageError(f"{name!r} is not an incident bundle's name (memwatch-incident-….tar.gz); not spooled")
        fd, info = open_regular(src_fd, name)
        try:
            if self.holds(name):  # handed on before, by a sidecar stopped before the source was removed
                unlink_if_same(src_fd, name, file_id(info))
                return
            try:
                os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=self.fd)
                moved = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                if file_id(moved) != file_id(info) or not stat.S_ISREG(moved.st_mode):  # swapped in between
                    os.rename(name, name, src_dir_fd=self.fd, dst_dir_fd=src_fd)
                    raise UsageError(f"{name} changed while it was spooled; not shipped")
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                self._copy_in(fd, name)
                unlink_if_same(src_fd, name, file_id(info))
        finally:
            os.close(fd)
        os.fsync(self.fd)
        self.enforce_cap(keep=name)
        if self.on_enqueue is not None:
            self.on_enqueue()

    def sizes(self) -> list[tuple[str, int]]:
        """The bundles waiting and their sizes, oldest first."""
        found: list[tuple[int, str, int]] = []
        for name in self._names():
            if not BUNDLE_NAME.fullmatch(name):
                continue
            try:
                info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode):
                found.append((info.st_mtime_ns, name, info.st_size))
        return [(name, size) for _, name, size in sorted(found)]

    def oldest(self) -> tuple[str, int] | None:
        """The bundle waiting longest and when it was written (ns), or None."""
        best: tuple[int, str] | None = None
        for name in self._names():
            if BUNDLE_NAME.fullmatch(name):
                try:
                    info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode) and (best is None or (info.st_mtime_ns, name) < best):
                    best = (info.st_mtime_ns, name)
        return None if best is None else (best[1], best[0])

    def enforce_cap(self, keep: str | None = None) -> list[str]:
        """Drop the oldest bundles until the spool holds at most :attr:`cap_count` bundles and :attr:`cap_bytes`
        bytes (``keep``, the newest, always stays); the names dropped. Each is told to :attr:`on_drop`."""
        waiting = self.sizes()
        total, count = sum(size for _, size in waiting), len(waiting)
        dropped = []
        for name, size in waiting:
            if total <= self.cap_bytes and count <= self.cap_count:
                break
            if name == keep:
                continue
            why = (f"the spool holds {count} bundles, over its cap of {self.cap_count}" if count > self.cap_count
                   else f"the spool holds {total:,} bytes, over its cap of {self.cap_bytes:,}")
            try:
                fd, info = open_regular(self.fd, name)
                os.close(fd)
                if not unlink_if_same(self.fd, name, file_id(info)):
                    continue
            except OSError:
                continue
            total, count = total - size, count - 1
            dropped.append(name)
            self.dropped += 1
            log.warning("bundle_dropped %s (%d bytes): %s; the oldest go first", name, size, why)
            if self.on_drop is not None:
                try:
                    self.on_drop(name, size, why)
                except Exception as exc:  # telling of it must never keep the spool over its cap
                    log.error("bundle %s dropped, not recorded: %s", name, exc)
        return dropped

    def holds(self, name: str) -> bool:
        """Whether the regular file ``name`` waits in the spool."""
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _copy_in(self, src: int, name: str) -> None:
        tmp = f".{name}.tmp"
        try:
            os.unlink(tmp, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        out = create_exclusive(self.fd, tmp, 0o600, os.O_WRONLY)
        try:
            os.lseek(src, 0, os.SEEK_SET)
            while chunk := os.read(src, COPY_CHUNK):
                os.write(out, chunk)
            os.fsync(out)
        except BaseException:
            os.close(out)
            os.unlink(tmp, dir_fd=self.fd)
            raise
        os.close(out)
        os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def pending(self) -> list[str]:
        """The bundles waiting, oldest first (by modification time, then name)."""
        return [name for name, _ in self.sizes()]

    def open(self, name: str) -> tuple[int, os.stat_result]:
        """A read descriptor of the spooled bundle ``name`` and its ``fstat`` (regular files only)."""
        return open_regular(self.fd, name)

    def remove(self, name: str, ident: tuple[int, int]) -> None:
        """Delete a shipped bundle, only while its name still denotes the file that was uploaded."""
        unlink_if_same(self.fd, name, ident)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def activate(spool: Spool | None) -> None:
    """Make ``spool`` the one :func:`enqueue` feeds (the sidecar's, while it ships; ``None`` when it stops)."""
    global _active
    with _active_lock:
        _active = spool


def enqueue(path: Path) -> None:
    """Hand a finished bundle to the running sidecar's spool; without one (no ``--bundle-to``), it stays at ``path``."""
    with _active_lock:
        spool = _active
    if spool is None:
        log.info("bundle %s kept at %s (no --bundle-to)", Path(path).name, path)
        return
    spool.enqueue(path)


def identity(info: os.stat_result) -> tuple[int, int]:
    """What :meth:`Spool.remove` compares against."""
    return file_id(info)
