"""How ``attach --inject`` runs a program: a trusted file, a scrubbed environment, the target's own user.

memwatch is often run as root. A program it starts must never be one a local user can plant (a
``gdb`` early on a writable ``PATH`` entry, the target's own executable) and must not inherit what
a user can steer (``LD_PRELOAD``, ``PYTHONPATH``, ``HOME`` with a ``.gdbinit``, a working directory
they own). So: tools are looked up only in absolute ``PATH`` entries owned by root or by us and
writable by no one else, and must themselves be such files; each runs with :data:`CLEAN_ENV`, in
``/``, and with the target process's uid and gid (and no supplementary groups) when memwatch is root.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..errors import NotFoundError

CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CLEAN_ENV = {"PATH": CLEAN_PATH, "LC_ALL": "C", "HOME": "/nonexistent"}
"""The whole environment of a program memwatch starts for an injection."""


def trusted_file(path: str | Path, owners: tuple[int, ...] | None = None) -> bool:
    """``path`` is owned by root or by us (or one of ``owners``) and no one else may write it or its folder."""
    allowed = owners if owners is not None else (0, os.geteuid())
    try:
        real = Path(os.path.realpath(path))
        for part in (real, real.parent):
            info = os.stat(part)
            if info.st_uid not in allowed or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return False
        return stat.S_ISREG(os.stat(real).st_mode)
    except OSError:
        return False


def trusted_tool(name: str, search_path: str | None = None) -> str | None:
    """The absolute path of ``name`` from memwatch's own ``PATH``, skipping any entry a user could have planted."""
    search_path = os.environ.get("PATH", "") if search_path is None else search_path
    for entry in search_path.split(os.pathsep):
        if not os.path.isabs(entry):
            continue  # "" and "." mean the working directory: never trusted
        candidate = os.path.join(entry, name)
        if os.access(candidate, os.X_OK) and trusted_file(candidate):
            return os.path.realpath(candidate)
    return None


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
