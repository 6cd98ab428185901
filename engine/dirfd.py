"""Acting in a directory another uid can write, through a descriptor of that directory.

In a directory someone else can write, a path means nothing twice: between two system calls that
name it, a symlink, a FIFO or another file may take its place. So every operation here names an
entry relative to a directory descriptor opened once (``openat``, ``unlinkat``, ``renameat``), never
follows a symlink (``O_NOFOLLOW``), never blocks on a FIFO (``O_NONBLOCK``), creates only what did not
exist (``O_EXCL``), and judges what it opened by ``fstat`` of the open descriptor: the file itself, not
whatever the name denotes a moment later.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
"""Added to every open of an entry: no symlink followed, no wait on a FIFO, no controlling terminal taken."""
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_LIMIT = 4096
"""The most bytes :func:`read_small` reads: the small files memwatch keeps beside its rings."""


class NotRegularFile(OSError):
    """The entry is a symlink, a FIFO, a device, a socket or a directory, where a regular file was expected."""


def open_dir(path: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``path`` (its last component must not be a symlink)."""
    return os.open(path, DIR_FLAGS, dir_fd=dir_fd)


def reopen_dir(dir_fd: int) -> int:
    """A descriptor of the folder ``dir_fd`` with a read offset of its own, to list it: every duplicate of one
    descriptor shares one offset, so two threads listing ``dir_fd`` itself at once each see part of the folder,
    or none of it, or names twice."""
    return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)


def list_names(dir_fd: int) -> list[str]:
    """The names in the folder ``dir_fd`` (through :func:`reopen_dir`: any thread may list it at any time)."""
    fd = reopen_dir(dir_fd)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def file_id(info: os.stat_result) -> tuple[int, int]:
    """What names a file whatever its path: (device, inode)."""
    return info.st_dev, info.st_ino


def open_regular(dir_fd: int, name: str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """Open the regular file ``name`` in the directory ``dir_fd``; (descriptor, ``fstat`` of it).

    Anything else is refused (:class:`NotRegularFile`): looked at first without opening it, so a FIFO or a
    device is not even opened, and judged again by ``fstat`` of what was opened, since the name may have
    been swapped between the two.
    """
    if os.sep in name or name in ("", ".", ".."):
        raise NotRegularFile(errno.EINVAL, "not a plain file name", name)
    before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(before.st_mode):
        raise NotRegularFile(errno.EINVAL, f"not a regular file ({_kind(before.st_mode)})", name)
    fd = os.open(name, flags | OPEN_FLAGS, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(errno.EINVAL, f"not a regular file ({_kind(info.st_mode)})", name)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def create_exclusive(dir_fd: int, name: str, mode: int, flags: int = os.O_RDWR) -> int:
    """Create ``name`` in ``dir_fd``, failing if anything (a symlink included) is there; exactly ``mode``."""
    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, mode, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)  # whatever the umask took away
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(dir_fd: int, name: str, owner: int | None = None, limit: int = READ_LIMIT) -> bytes:
    """The first ``limit`` bytes of the regular file ``name`` (owned by ``owner`` when given), read by descriptor."""
    fd, info = open_regular(dir_fd, name)
    try:
        if owner is not None and info.st_uid != owner:
            raise PermissionError(errno.EPERM, f"owned by uid {info.st_uid}, not {owner}", name)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def replace_file(dir_fd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``name`` whole in a directory of our own: a new temporary file, then an atomic rename over it."""
    tmp = f".{name}.tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # a leftover of a process killed mid-write
    except FileNotFoundError:
        pass
    fd = create_exclusive(dir_fd, tmp, mode, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def unlink_if_same(dir_fd: int, name: str, ident: tuple[int, int]) -> bool:
    """Remove ``name`` only while it still denotes the file ``ident`` (see :func:`file_id`); whether it did.

    In a sticky directory only the entry's owner (or the directory's) may replace it, so the file judged
    is the one removed unless that owner swaps it between the look and the removal.
    """
    try:
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if file_id(now) != ident:
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def private_dir(path: str | os.PathLike[str], *, create: bool = True) -> int:
    """A descriptor of a directory that is ours alone: owned by our uid, mode 0700 (created so when missing).

    Its parents are created (0700) when missing; the directory itself is opened without following a symlink
    and judged by ``fstat``, so what is used afterwards, by descriptor, is what was checked.
    """
    path = Path(path)
    if create:
        _make_parents(path)
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return private_subdir(parent, path.name, create=create, shown=path)
    finally:
        os.close(parent)


def _make_parents(path: Path) -> None:
    """The missing folders above ``path``, each 0700 (``Path.mkdir(parents=True)`` gives all but the last the
    umask's mode, 0755 under the usual 022)."""
    missing = []
    for parent in path.parents:
        if parent.exists():
            break
        missing.append(parent)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass


def private_subdir(dir_fd: int, name: str, *, create: bool = True, shown: str | os.PathLike[str] | None = None) -> int:
    """:func:`private_dir` for the entry ``name`` of the directory ``dir_fd``."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
    fd = open_dir(name, dir_fd=dir_fd)
    try:
        check_private(os.fstat(fd), shown if shown is not None else name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private(info: os.stat_result, path: str | os.PathLike[str]) -> None:
    """Refuse (``PermissionError``) a directory that is not ours or that others may enter."""
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    if info.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"belongs to uid {info.st_uid}, not {os.geteuid()}", str(path))
    if info.st_mode & 0o077:
        raise PermissionError(errno.EPERM, f"mode {info.st_mode & 0o7777:o} lets other users in; chmod 700 it",
                              str(path))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"
