"""Changes to the runtime directory as the kernel reports them (inotify), so finding a ring costs one event.

Listing a directory another uid has filled with two million names takes seconds however it is done; the kernel
can instead say which names were created, moved in, changed owner or mode, or removed. The watch is put on the
directory the sidecar opened and judged (``/proc/self/fd/N``: the same directory, whatever its path denotes now).
The kernel's queue is bounded (``fs.inotify.max_queued_events``): past it events are lost and one
``overflowed`` event says so, after which the caller lists the directory again. Where inotify cannot be used
(no such call, no watches left for this uid) :func:`watch_dir` returns None and the caller lists as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
from dataclasses import dataclass

log = logging.getLogger("memwatch.collector")

IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
WATCHED = IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
"""What the finder needs: names that appear (or change owner or mode) and names that go."""
APPEARED = IN_CREATE | IN_MOVED_TO | IN_ATTRIB
GONE = IN_DELETE | IN_MOVED_FROM
_EVENT = struct.Struct("iIII")
READ_BYTES = 64 * 1024
"""Read at once: about 2,000 events of ring-sized names."""


@dataclass(frozen=True)
class Change:
    """One name's change: ``appeared`` (created, moved in, owner or mode changed) or gone."""

    name: str
    appeared: bool


class DirWatch:
    """An inotify descriptor watching one directory; :meth:`changes` reads what is queued without waiting."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.overflowed = False
        """Events were lost (the kernel's queue was full, or the watch ended): the directory must be listed again."""

    def fileno(self) -> int:
        return self._fd

    def changes(self, max_reads: int = 16) -> list[Change]:
        """The changes queued now (at most ``max_reads`` reads of :data:`READ_BYTES`); never waits."""
        found: list[Change] = []
        for _ in range(max_reads):
            try:
                data = os.read(self._fd, READ_BYTES)  # whole records; an empty queue is EAGAIN, never b""
            except BlockingIOError:
                break
            except OSError as exc:
                log.error("cannot read the runtime directory's changes: %s; listing it instead", exc.strerror)
                self.overflowed = True
                break
            found.extend(self._parse(data))
        return found

    def _parse(self, data: bytes) -> list[Change]:
        found = []
        offset = 0
        for _ in range(len(data) // _EVENT.size):  # no more records than headers fit: ends whatever lengths say
            if offset + _EVENT.size > len(data):
                break
            _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            raw = data[offset + _EVENT.size:offset + _EVENT.size + length].partition(b"\0")[0]
            offset += _EVENT.size + length
            if mask & (IN_Q_OVERFLOW | IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
                self.overflowed = True
            if raw and mask & (APPEARED | GONE):
                found.append(Change(os.fsdecode(raw), bool(mask & APPEARED)))
        return found

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def watch_dir(dir_fd: int) -> DirWatch | None:
    """A watch on the directory open as ``dir_fd``; None (one warning) where inotify cannot be used."""
    # The C library is already in the process: no search for it (find_library runs ldconfig or a compiler). Every
    # Linux C library has the calls; a kernel or a seccomp profile without them makes them fail (ENOSYS), below.
    libc = ctypes.CDLL(None, use_errno=True)
    init, add = libc.inotify_init1, libc.inotify_add_watch
    init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
    add.argtypes, add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
    fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd == -1:
        log.warning("cannot watch the runtime directory (%s): it is listed at every scan instead, which a flood "
                    "of names slows down", os.strerror(ctypes.get_errno()))
        return None
    if add(fd, f"/proc/self/fd/{dir_fd}".encode(), WATCHED | IN_ONLYDIR) == -1:
        err = ctypes.get_errno()
        os.close(fd)
        log.warning("cannot watch the runtime directory (%s%s): it is listed at every scan instead",
                    os.strerror(err), "; raise fs.inotify.max_user_watches" if err == errno.ENOSPC else "")
        return None
    return DirWatch(fd)
