"""Where rings and the sidecar's lock live, and the permission rules that keep them private.

The runtime directory is ``$MEMWATCH_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/memwatch``, else
``/tmp/memwatch-<uid>``. It is created with mode 0700 and must be owned by the current user with no
group or other access: anyone who can write there could feed the sidecar forged records.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

RING_SUFFIX = ".ring"
LOCK_NAME = "sidecar.lock"
PID_NAME = "sidecar.pid"
LOG_NAME = "sidecar.log"


class RuntimeDirError(Exception):
    """The runtime directory cannot be used safely."""


def default_runtime_dir() -> Path:
    explicit = os.environ.get("MEMWATCH_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "memwatch"
    return Path(f"/tmp/memwatch-{os.getuid()}")


def ensure_runtime_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Create (0700) or validate the runtime directory; raise :class:`RuntimeDirError` if it is unsafe."""
    directory = Path(path) if path is not None else default_runtime_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise RuntimeDirError(f"cannot create runtime directory {directory}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"runtime directory {directory} is not a directory (a symlink?); remove it")
    if info.st_uid != os.getuid():
        raise RuntimeDirError(
            f"runtime directory {directory} belongs to uid {info.st_uid}, not you; "
            "set MEMWATCH_RUNTIME_DIR to a directory of your own"
        )
    if info.st_mode & 0o077:
        raise RuntimeDirError(
            f"runtime directory {directory} is accessible to other users (mode {info.st_mode & 0o777:o}); "
            f"run: chmod 700 {directory}"
        )
    return directory


def ring_path(directory: Path, run_id: str, rank: int) -> Path:
    return directory / f"{run_id}-r{rank}{RING_SUFFIX}"


def is_private_file(path: Path) -> tuple[bool, str]:
    """Whether a file in the runtime directory may be trusted: ours, regular, no group/other access."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return False, exc.strerror or "unreadable"
    if not stat.S_ISREG(info.st_mode):
        return False, "not a regular file"
    if info.st_uid != os.getuid():
        return False, f"owned by uid {info.st_uid}, not by this user"
    if info.st_mode & 0o077:
        return False, f"mode {info.st_mode & 0o777:o} lets other users write it"
    return True, ""
