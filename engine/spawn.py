"""Start a sidecar for the runtime directory when none is running, so ``MEMWATCH=1`` just works.

One sidecar per runtime directory: it holds a lock on ``sidecar.lock`` in its state directory for its
whole life (an open-file-description lock, which the kernel drops when the process dies). Here we only
ask about that lock (``F_OFD_GETLK``: asking never takes it, so it never gets in a starting sidecar's
way); if nobody holds it we start ``python -m memwatch serve`` in its own session, through a launcher that
exits at once, so the sidecar is no descendant of the engine (it outlives the engine: neither a crash
nor an engine killing its own process tree takes it down). Two ranks racing here at once both start one;
the loser fails to take the lock and exits quietly.

Only in a private runtime directory (ours, 0700, where the sidecar's state directory is the runtime
directory itself). A shared group directory has its node agent: an engine never starts a sidecar there
and never creates a file there but its ring; it only reads the agent's ``sidecar.present`` marker,
which tells whether one runs (a hint: any group member could have made it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from .dirfd import open_dir, read_small
from .liveness import file_lock_held
from .runtime import LOCK_NAME, LOG_NAME, PID_NAME, PRESENCE_NAME, is_shared_dir

IDLE_EXIT_SECONDS = 60


def sidecar_running(directory: Path) -> bool:
    """True when a sidecar holds the lock of ``directory`` (or, shared, its presence marker); creates nothing."""
    try:
        dir_fd = open_dir(directory)
    except OSError:
        return False
    try:
        names = (LOCK_NAME, PRESENCE_NAME) if _ours(dir_fd) else (PRESENCE_NAME,)
        return any(file_lock_held(dir_fd, name) for name in names)
    finally:
        os.close(dir_fd)


def sidecar_pid(directory: Path) -> int | None:
    """The pid in a private runtime directory's ``sidecar.pid`` (our own file; None in a shared directory)."""
    try:
        dir_fd = open_dir(directory)
    except OSError:
        return None
    try:
        return int(read_small(dir_fd, PID_NAME, owner=os.getuid(), limit=256).split()[0]) if _ours(dir_fd) else None
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(dir_fd)


def _ours(dir_fd: int) -> bool:
    """Whether the directory is a private one of ours (not shared): its files are ours alone to make."""
    info = os.fstat(dir_fd)
    return not is_shared_dir(info) and info.st_uid == os.getuid()


def ensure_sidecar(directory: Path) -> bool:
    """Start a detached sidecar unless one is running. Returns True when one was started.

    Never in a shared group directory, or in one not ours: nothing is created there.
    """
    try:
        dir_fd = open_dir(directory)
    except OSError:
        return False
    try:
        if not _ours(dir_fd) or sidecar_running(directory):
            return False
        try:
            log_fd = os.open(LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC | os.O_NOCTTY, 0o600, dir_fd=dir_fd)
        except OSError:
            log_fd = -1
    finally:
        os.close(dir_fd)
    output: int = log_fd if log_fd >= 0 else subprocess.DEVNULL
    serve = [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(directory),
             "--exit-when-idle", str(IDLE_EXIT_SECONDS), "--quiet-if-running"]
    try:
        launcher = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, *serve],
            stdin=subprocess.DEVNULL, stdout=output, stderr=output,
            start_new_session=True, close_fds=True,
            env={**os.environ, "MEMWATCH": "0"},
        )
    finally:
        if log_fd >= 0:
            os.close(log_fd)
    # The launcher exits as soon as the sidecar is started: reap it, so it never lingers as a zombie of the engine.
    threading.Thread(target=launcher.wait, name="memwatch-sidecar-reaper", daemon=True).start()
    return True


_LAUNCH = "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True, close_fds=True)"
"""Started in the engine's place, this starts the sidecar and exits: the sidecar is then nobody's child in the
engine's process tree. An engine that tears down its children by walking that tree (vLLM's ``kill_process_tree``
SIGKILLs every descendant of its engine core and workers) would otherwise kill the sidecar with them, before it
finished the engine's run."""
