"""How ``attach --inject`` runs a program: a trusted file, opened once, run from that descriptor, as the target's user.

memwatch is often run as root. A program it starts must never be one a local user can plant (a
``gdb`` early on a writable ``PATH`` entry, the target's own executable) or swap in between a check
and the start (a folder above the tool renamed for another). So a program is reached from ``/`` one
folder at a time through directory descriptors (``openat`` with ``O_NOFOLLOW``; a symbolic link is
read and followed by hand, only from a folder already judged), every folder owned by root or by us
and writable by no one else, the file itself regular and likewise owned; what was judged is the
open descriptor (``fstat``), and that very descriptor is executed (``/proc/self/fd/N``), so no path
is looked up twice. Tools are searched in absolute ``PATH`` entries only. Each program runs with
:data:`CLEAN_ENV`, in ``/``, and with the target process's uid and gid (and no supplementary groups)
when memwatch is root: nothing it inherits (``LD_PRELOAD``, ``HOME`` with a ``.gdbinit``, a working
directory) is the user's.
"""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import NotFoundError, UnavailableError

CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CLEAN_ENV = {"PATH": CLEAN_PATH, "LC_ALL": "C", "HOME": "/nonexistent"}
"""The whole environment of a program memwatch starts for an injection."""
MAX_LINKS = 40
"""Symbolic links followed in one walk, as the kernel's own limit (``ELOOP``)."""
_OPEN = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UntrustedError(Exception):
    """Why a path is not one memwatch may execute: one sentence naming the part that failed."""


@dataclass(frozen=True)
class TrustedFile:
    """An ``O_PATH`` descriptor of a judged file (3 or above), and the path it was reached by, for messages."""

    fd: int
    path: str

    @property
    def exec_path(self) -> str:
        """What ``execve`` runs: the descriptor itself, in the process that inherited it."""
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> TrustedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _owners(owners: tuple[int, ...] | None) -> tuple[int, ...]:
    return owners if owners is not None else (0, os.geteuid())


def _judge(info: os.stat_result, where: str, owners: tuple[int, ...], *, folder: bool = False) -> None:
    """A folder or a regular file, owned by one of ``owners``, that no one else may write."""
    if not (stat.S_ISDIR if folder else stat.S_ISREG)(info.st_mode):
        raise UntrustedError(f"{where} is not a {'folder' if folder else 'regular file'}")
    if info.st_uid not in owners:
        raise UntrustedError(f"{where} belongs to uid {info.st_uid}" + (", who could swap what it holds" if folder
                                                                          else ""))
    if info.st_mode & _OTHERS_WRITE:
        raise UntrustedError(f"{where} is writable by others (mode {info.st_mode & 0o7777:o})")


def _judge_folder(fd: int, where: str, owners: tuple[int, ...]) -> None:
    _judge(os.fstat(fd), where, owners, folder=True)


def _above_two(fd: int) -> int:
    """``fd`` moved to 3 or above: a child's standard streams are put on 0 to 2 and must not cover it."""
    if fd > 2:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def open_trusted(path: str | Path, owners: tuple[int, ...] | None = None) -> TrustedFile:
    """The regular file at absolute ``path``, opened ``O_PATH`` after judging every folder from ``/`` down.

    Each step opens one name relative to the folder before it (``O_NOFOLLOW``), so a folder renamed
    after it was judged changes nothing; a symbolic link is followed only out of a judged folder,
    whose owner alone could have made it. Raises :class:`UntrustedError` saying which part failed.
    """
    allowed = _owners(owners)
    text = os.fspath(path)
    if not os.path.isabs(text):
        raise UntrustedError(f"{text!r} is not an absolute path")
    pending: deque[str] = deque(part for part in text.split("/") if part not in ("", "."))
    current = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    where: list[str] = []
    links = 0
    try:
        _judge_folder(current, "/", allowed)
        while pending:
            name = pending.popleft()
            if name == "..":
                parent = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=current)
                os.close(current)
                current = parent
                if where:
                    where.pop()
                _judge_folder(current, "/" + "/".join(where), allowed)
                continue
            fd = os.open(name, _OPEN, dir_fd=current)
            info = os.fstat(fd)
            shown = "/" + "/".join([*where, name])
            if stat.S_ISLNK(info.st_mode):
                os.close(fd)
                links += 1
                if links > MAX_LINKS:
                    raise UntrustedError(f"{text} goes through more than {MAX_LINKS} symbolic links")
                target = os.readlink(name, dir_fd=current)
                if target.startswith("/"):
                    os.close(current)
                    current = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                    where = []
                    _judge_folder(current, "/", allowed)
                pending.extendleft(reversed([part for part in target.split("/") if part not in ("", ".")]))
                continue
            if not pending:
                try:
                    _judge(info, shown, allowed)
                except BaseException:
                    os.close(fd)
                    raise
                return TrustedFile(_above_two(fd), shown)
            os.close(current)
            current = fd
            where.append(name)
            _judge_folder(current, shown, allowed)
        raise UntrustedError(f"{text} names a folder, not a file")
    except OSError as exc:
        raise UntrustedError(f"{text}: {exc.strerror or exc}") from None
    finally:
        os.close(current)


def trusted_file(path: str | Path, owners: tuple[int, ...] | None = None) -> bool:
    """Whether ``path`` is a regular file owned by root or by us (or one of ``owners``) that no one else may
    change, in folders no one else may change, all the way up."""
    try:
        open_trusted(path, owners).close()
    except UntrustedError:
        return False
    return True


def trusted_tool(name: str, search_path: str | None = None) -> str | None:
    """The path of ``name`` in memwatch's own ``PATH``, skipping every entry a user could have planted or swap."""
    search_path = os.environ.get("PATH", "") if search_path is None else search_path
    for entry in search_path.split(os.pathsep):
        if not os.path.isabs(entry):
            continue  # "" and "." mean the working directory: never searched
        try:
            with open_trusted(os.path.join(entry, name)) as found:
                if os.fstat(found.fd).st_mode & 0o111:
                    return found.path
        except UntrustedError:
            continue
    return None


def open_tool(path: str) -> TrustedFile:
    """``path`` (from :func:`trusted_tool`) opened and judged again: the descriptor that is then executed."""
    try:
        return open_trusted(path)
    except UntrustedError as exc:
        raise UnavailableError(f"{exc}; memwatch runs no program another user could have put there or swap") \
            from None


def open_interpreter(pid: int, owners: tuple[int, ...]) -> TrustedFile:
    """The very file process ``pid`` runs (``/proc/PID/exe``), when its path also walks as trusted to it."""
    exe = f"/proc/{pid}/exe"
    fd = _above_two(os.open(exe, os.O_PATH | os.O_CLOEXEC))
    try:
        info = os.fstat(fd)
        named = os.readlink(exe).removesuffix(" (deleted)")
        _judge(info, named, owners)
        with open_trusted(named, owners) as walked:
            again = os.fstat(walked.fd)
        if (again.st_dev, again.st_ino) != (info.st_dev, info.st_ino):
            raise UntrustedError(f"{named} is no longer the file process {pid} runs")
    except (OSError, UntrustedError):
        os.close(fd)
        raise
    return TrustedFile(fd, named)


def own_interpreter() -> TrustedFile:
    """This interpreter's own binary, by descriptor (``/proc/self/exe``)."""
    return TrustedFile(_above_two(os.open("/proc/self/exe", os.O_PATH | os.O_CLOEXEC)), sys.executable)


def start(program: TrustedFile, args: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """Run the judged descriptor itself, with ``args`` after its path as ``argv[0]``: no path is resolved again."""
    return subprocess.Popen([program.path, *args], executable=program.exec_path, pass_fds=(program.fd,), **popen)


def process_ids(pid: int) -> tuple[list[int], list[int]]:
    """The process's uids and gids (real, effective, saved, filesystem), from ``/proc/PID/status``."""
    uids: list[int] = []
    gids: list[int] = []
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                uids = [int(part) for part in line.split()[1:]]
            elif line.startswith("Gid:"):
                gids = [int(part) for part in line.split()[1:]]
    except FileNotFoundError:
        raise NotFoundError(f"no process {pid}; check the pid with ps") from None
    except (OSError, ValueError):
        pass
    return uids, gids


def as_target(pid: int) -> dict[str, Any]:
    """``subprocess`` arguments that run a program as ``pid``'s user, in ``/``, with :data:`CLEAN_ENV` only."""
    kwargs: dict[str, Any] = {"env": dict(CLEAN_ENV), "cwd": "/"}
    if os.geteuid() == 0:
        uids, gids = process_ids(pid)
        kwargs.update(user=uids[0] if uids else 65534, group=gids[0] if gids else 65534, extra_groups=[])
    return kwargs
