"""How a sidecar can tell a ring's writer is alive without seeing its pid.

The engine is often in a pid namespace of its own (its container) while the sidecar is in another, so
the writer pid in a ring's header may name nothing, or another process, in the sidecar's ``/proc``.
Instead the writer holds a process-associated record lock (``F_SETLK``, a write lock on the whole ring)
from the ring's creation to its close. The kernel drops it when the process dies, however it dies, and
it is visible to any process that opens the same file on the same kernel, whatever its namespaces. The
sidecar asks with ``F_OFD_GETLK``, which never takes a lock, so it cannot get in the writer's way (an
open-file-description lock and a process's record lock conflict, so the question sees it). The lock is
taken once, when the ring is created: the hot path never touches it.

Why a process's record lock and not an open-file-description lock: a child made by ``fork()`` shares
its parent's open file descriptions, and with them an OFD lock. Python's at-fork hooks can close the
descriptor in the child, but a C extension calling libc's ``fork()`` runs no Python hook, and its child
kept a dead engine "alive" for as long as it lived. A record lock belongs to the process: ``fork()``
never passes it on.

The trap that comes with it: closing ANY descriptor of the ring's file in the writer's process drops
the lock (POSIX semantics), even a descriptor opened for reading. So the writer's process never opens
its ring a second time: the ring is created, mapped and locked through one descriptor (:mod:`.ring`),
which stays open until the ring is closed; nothing in the engine reads a ring by path. A reader in the
writer's own process (a test, an in-process collector) ends the writer's lock when it closes its
descriptor: the ring then reads as "writer gone".

The writer also records its pid namespace (the inode of ``/proc/self/ns/pid``); a sidecar checks the
pid as well only where that namespace is its own.
"""

from __future__ import annotations

import fcntl
import os
import struct

from .dirfd import open_regular

_FLOCK = struct.Struct("hhqqi4x")
"""``struct flock`` on 64-bit Linux: type, whence, start, len, pid (and padding)."""

_LOCK_FDS: set[int] = set()
"""Descriptors holding a writer lock; a forked child holds no lock on them and closes its copies."""


def process_start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or 0 when it cannot be
    read: with the pid, it tells a dead writer from a process that was given its pid since."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def take_writer_lock(fd: int) -> bool:
    """Hold this process's write lock on the whole file of ``fd`` until ``fd`` (or any other descriptor of the
    file in this process) is closed; False where locks are refused."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except (OSError, AttributeError, ValueError):
        return False
    _LOCK_FDS.add(fd)
    return True


def release_writer_lock(fd: int) -> bool:
    """Forget ``fd``; True when the caller should close it (False: a forked child already closed it)."""
    if fd not in _LOCK_FDS:
        return False
    _LOCK_FDS.discard(fd)
    return True


def writer_lock_held(fd: int) -> bool | None:
    """Whether another open of the file holds a lock on it: True, False, or None when locks cannot be asked."""
    try:
        result = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0))
        kind = _FLOCK.unpack(result)[0]
    except (OSError, AttributeError, ValueError, struct.error):
        return None
    return kind != fcntl.F_UNLCK


def file_lock_held(dir_fd: int, name: str) -> bool:
    """Whether another open of the regular file ``name`` in the directory ``dir_fd`` holds a lock on it (a
    sidecar's lock or presence marker); False when it is missing, not a regular file, or locks cannot be asked."""
    try:
        fd, _ = open_regular(dir_fd, name)
    except OSError:
        return False
    try:
        return writer_lock_held(fd) is True
    finally:
        os.close(fd)


def pid_namespace(pid: int | str = "self") -> int | None:
    """The inode of a process's pid namespace (None when /proc does not say)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _close_in_child() -> None:
    # A forked child holds no record lock (fork never passes one on); its copies of the descriptors are closed
    # so that it keeps no file of its parent's open.
    for fd in tuple(_LOCK_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_in_child)
