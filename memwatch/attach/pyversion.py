"""Which Python a process runs, learnt without executing anything of it.

A process's executable and libraries belong to whoever started it; running them (even with ``-I -S``)
from a memwatch started by root would run a local user's program as root. So the version is read:
from the libpython that ``/proc/PID/maps`` names, from the interpreter's file name, or from the
interpreter's bytes (CPython keeps its ``PY_VERSION`` string, such as ``3.11.2``, as a NUL-ended
constant). Every read is bounded.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

MAPS_LIMIT = 4 << 20
"""Bytes of ``/proc/PID/maps`` read at most (a process mapping PyTorch has a few thousand lines, ~1 MB)."""
EXE_LIMIT = 64 << 20
"""Bytes of the executable scanned for the version string at most (a static CPython is about 7 MB)."""
_CHUNK = 1 << 20

_LIBPYTHON = re.compile(rb"/libpython(3)\.(\d{1,2})[a-z]*\.so")
_NAMED = re.compile(r"^python(3)\.(\d{1,2})[a-z]?\Z")
_PY_VERSION = re.compile(rb"\x003\.(\d{1,2})\.\d{1,2}(?:(?:a|b|rc)\d{1,2})?\+?\x00")
_CPYTHON_MARK = b"_PyRuntime"
"""A symbol every CPython 3.7+ interpreter exports (debuggers read it), checked beside the version string."""


def mapped_libpython(pid: int) -> tuple[int, int] | None:
    """The version of the libpython ``pid`` maps, if any."""
    raw = _read_bounded(f"/proc/{pid}/maps", MAPS_LIMIT)
    found = _LIBPYTHON.search(raw) if raw else None
    return (int(found.group(1)), int(found.group(2))) if found else None


def named_version(exe: str) -> tuple[int, int] | None:
    """The version in an interpreter's file name (``python3.12``), if it carries one."""
    found = _NAMED.match(os.path.basename(exe))
    return (int(found.group(1)), int(found.group(2))) if found else None


def embedded_version(pid: int) -> tuple[int, int] | None:
    """The version CPython's executable carries in its bytes; ``None`` when it carries none, or several."""
    versions: set[tuple[int, int]] = set()
    marked = False
    try:
        fd = os.open(f"/proc/{pid}/exe", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not _is_regular(fd):
            return None
        tail = b""
        read = 0
        while read < EXE_LIMIT:
            chunk = os.read(fd, min(_CHUNK, EXE_LIMIT - read))
            if not chunk:
                break
            read += len(chunk)
            window = tail + chunk
            # minor >= 6: the bytes also hold the Unicode database's own "3.2.0"
            versions.update((3, int(m.group(1))) for m in _PY_VERSION.finditer(window) if int(m.group(1)) >= 6)
            marked = marked or _CPYTHON_MARK in window
            tail = window[-32:]
    except OSError:
        return None
    finally:
        os.close(fd)
    return versions.pop() if marked and len(versions) == 1 else None


def _is_regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)


def _read_bounded(path: str | Path, limit: int) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        parts: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, min(_CHUNK, limit - size))
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)
    except OSError:
        return None
    finally:
        os.close(fd)
