"""A sidecar's claim on its runtime directory: the lock in its state directory, taken at once or over from an
auto-started sidecar.

An auto-started sidecar (``exit_when_idle``) only stands in until someone runs ``memwatch serve``: it is asked
to stop (SIGTERM: its last drain and commit), and its lock is taken once it has gone. The rings keep what it
did not store, and their cursors say where to resume. A pid read from the pid file is signalled only while it
is still that sidecar (:func:`~memwatch.sidecar.sidecar_files.signal_sidecar`); the lock decides the rest.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from ..errors import PermissionDeniedError, UnavailableError
from .sidecar_files import PidFile, StateDir, signal_sidecar

HANDOVER_WAIT_S = 30.0
"""How long ``memwatch serve`` waits for an auto-started sidecar to stop: its last drain and commit."""


class SidecarRunning(UnavailableError):
    """Another sidecar already serves this runtime directory."""


def claim(state_dir: Path, runtime_fd: int | None, runtime_dir: Path, *, auto: bool) -> tuple[StateDir, int | None]:
    """The state directory, locked, with this sidecar's pid published; and the pid of the auto-started sidecar it
    took over from (``None``: none). ``auto``: this sidecar was started by the plugin (it never displaces
    another). :class:`SidecarRunning` when another serves ``runtime_dir``."""
    try:
        state = StateDir(state_dir, runtime_fd)
    except OSError as exc:
        raise PermissionDeniedError(
            f"cannot use {state_dir} as the sidecar's state directory: {exc.strerror or exc}; it must be a "
            "directory of the sidecar's user, mode 0700 (pass another with --state-dir)") from None
    try:
        locked, took_over_from = _lock_or_take_over(state, auto)
        if not locked:
            holder = state.read_pid()
            raise SidecarRunning(
                f"a sidecar is already running for {runtime_dir}"
                + (f" (pid {holder.pid})" if holder else "") + "; stop it first or pass another --runtime-dir"
            )
        if state.another_serves_runtime_dir():
            raise SidecarRunning(f"a sidecar with another state directory is already running for "
                                 f"{runtime_dir}; stop it first or pass another --runtime-dir")
        state.write_pid(auto=auto)
        state.publish_presence()
    except BaseException:
        state.close()
        raise
    return state, took_over_from


def _lock_or_take_over(state: StateDir, auto: bool) -> tuple[bool, int | None]:
    """Whether the lock was taken: at once, or after the auto-started holder stopped (bounded wait); and that
    holder's pid."""
    if state.try_lock():
        return True, None
    if auto:
        return False, None  # an auto-started sidecar never displaces another
    deadline = time.monotonic() + HANDOVER_WAIT_S
    asked: PidFile | None = None
    while time.monotonic() < deadline:
        holder = state.read_pid()
        if holder is not None and not holder.auto:
            return False, None
        if holder is not None and holder != asked and signal_sidecar(holder, signal.SIGTERM):
            asked = holder  # a pid that is not that sidecar any more is never signalled: the lock decides
        time.sleep(0.05)  # the holder may not have written its pid file yet
        if state.try_lock():
            return True, None if asked is None else asked.pid
    return False, None
