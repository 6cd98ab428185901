"""A Monitor's life around the engine's: the end of the interpreter, and a sidecar that never came.

Exit: an engine that returns from ``main`` (or calls ``sys.exit``) without ``Monitor.close()`` would
leave its ring open, and the sidecar, seeing the writer gone without a ``run_end``, would record a
crash. So every running Monitor is closed by one ``atexit`` function, registered when the first
Monitor starts (never with memwatch off): status ``ok``, or ``error`` when the interpreter is exiting
on an uncaught exception it printed (``sys.last_value``), with ``"closed_at_exit": true`` in the
``run_end`` event. It never raises, waits at most the ring's close wait (0.5 s) per Monitor, does
nothing for a Monitor already closed, and nothing in a forked child (the ring is its parent's).

What no hook can see: ``os._exit()``, a fatal signal, the OOM killer. Those end the process without
running any Python code, so the ring is left open and the sidecar records ``crashed``; for
``os._exit(0)`` that is a clean exit recorded as a crash. Only the parent that reaps the process (the
container runtime, the kubelet) sees the exit status; the sidecar cannot, and memwatch does not guess.

The sidecar watch: a run whose rings nobody reads is lost without a word (an engine whose private
``/tmp`` hides the sidecar's default runtime directory, a sidecar that never started). One timer thread
per Monitor looks once, :data:`SIDECAR_WAIT_S` after the start, and logs one warning line when no
sidecar serves the runtime directory (or the directory never appeared). Nothing on the step's path.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

log = logging.getLogger("memwatch")

SIDECAR_WAIT_S = 30.0
"""How long after a Monitor starts the engine looks, once, for a sidecar serving its runtime directory."""


class Closable(Protocol):
    def close_at_exit(self, status: str) -> None: ...


_OPEN: dict[int, Closable] = {}
"""The running Monitors of this process, by id; held so that one the engine dropped is still closed at exit."""
_registered = False
_lock = threading.Lock()


def close_at_exit(monitor: Closable) -> None:
    """Close ``monitor`` when the interpreter exits, unless it was closed before (:func:`forget`)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_close_all)
            _registered = True
        _OPEN[id(monitor)] = monitor


def forget(monitor: Closable) -> None:
    with _lock:
        _OPEN.pop(id(monitor), None)


def exit_status() -> str:
    """``error`` when the interpreter is exiting after printing an uncaught exception, else ``ok``."""
    return "error" if getattr(sys, "last_value", None) is not None else "ok"


def _close_all() -> None:
    with _lock:
        monitors = list(_OPEN.values())
    status = exit_status()
    for monitor in monitors:
        try:
            monitor.close_at_exit(status)
        except BaseException:
            pass


class SidecarWatch:
    """One look, ``delay`` seconds from now, for a sidecar serving ``directory``; one warning if none does."""

    def __init__(self, directory: Callable[[], Path | None], waiting: Callable[[], bool],
                 delay: float | None = None) -> None:
        self._directory, self._waiting = directory, waiting
        self.delay = SIDECAR_WAIT_S if delay is None else delay
        self._timer = threading.Timer(self.delay, self._look)
        self._timer.name = "memwatch-sidecar-watch"
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()

    def _look(self) -> None:
        try:
            warning = self.warning()
        except Exception:  # a look that fails says nothing rather than something wrong
            return
        if warning:
            log.warning("%s", warning)

    def warning(self) -> str | None:
        """The line to log now, or None when a sidecar serves the directory."""
        directory = self._directory()
        if directory is None:
            return None
        seconds = f"{self.delay:.0f} s"
        advice = (f"start one (memwatch serve --runtime-dir {directory}, or the sidecar container of the "
                  "deployment), or point MEMWATCH_RUNTIME_DIR at the directory the sidecar serves (an engine "
                  "with a private /tmp does not see a sidecar's default directory)")
        if self._waiting():
            return (f"memwatch: nothing of this run is stored yet: the runtime directory {directory} has not "
                    f"appeared in {seconds}; it is the sidecar's to create, and its records are kept in memory "
                    f"until then: {advice}")
        from .spawn import sidecar_running

        if sidecar_running(directory):
            return None
        return (f"memwatch: no sidecar serves {directory} {seconds} after this run started, so its records are "
                f"not being stored: {advice}")
