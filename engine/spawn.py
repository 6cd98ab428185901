"""Start a sidecar for the runtime directory when none is running, so ``MEMWATCH=1`` just works.

One sidecar per runtime directory: it holds an exclusive ``flock`` on ``sidecar.lock`` for its whole
life. Here we only probe that lock; if it is free we start ``python -m memwatch serve`` in its own
session (it outlives the engine, and a crash of the engine never takes it down). Two ranks racing
here at once both start one; the loser fails to take the lock and exits quietly.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

from .runtime import LOCK_NAME, LOG_NAME

IDLE_EXIT_SECONDS = 60


def sidecar_running(directory: Path) -> bool:
    """True when some process holds the sidecar lock of ``directory``."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops our probe lock, if we took it
    return False


def ensure_sidecar(directory: Path) -> bool:
    """Start a detached sidecar unless one is running. Returns True when one was started."""
    if sidecar_running(directory):
        return False
    log_fd = os.open(directory / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(directory),
             "--exit-when-idle", str(IDLE_EXIT_SECONDS), "--quiet-if-running"],
            stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
            start_new_session=True, close_fds=True,
            env={**os.environ, "MEMWATCH": "0"},
        )
    finally:
        os.close(log_fd)
    # Reap it if it exits while we live (idle exit), so it never lingers as a zombie of the engine.
    threading.Thread(target=sidecar.wait, name="memwatch-sidecar-reaper", daemon=True).start()
    return True
