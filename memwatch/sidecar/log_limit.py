"""Log lines another uid can cause, limited: at most a few per minute per kind, then one line with a count.

A user who can create names in the runtime directory makes the sidecar say something about each; without
a limit, 500,000 names were 114 MB of log. Past the limit a line is dropped and counted; when its window
ends, one summary line says how many were dropped and what the last one was about.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

LINES_PER_WINDOW = 20
WINDOW_S = 60.0


@dataclass
class _Window:
    started: float
    lines: int = 0
    dropped: int = 0
    last: tuple[str, tuple[object, ...]] = ("", ())


class LogLimiter:
    """``warning(kind, msg, *args)`` logs at most ``lines`` lines of one ``kind`` per ``window`` seconds."""

    def __init__(self, log: logging.Logger, lines: int = LINES_PER_WINDOW, window: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._lines = lines
        self._window = window
        self._clock = clock
        self._kinds: dict[str, _Window] = {}
        self._lock = threading.RLock()  # the discovery thread, the loop and the store writer all refuse rings

    def warning(self, kind: str, msg: str, *args: object) -> None:
        # Decided under the lock, written after it: a log write that blocks (a stderr nobody reads) holds up the
        # thread writing, never the others that refuse rings or the sidecar's close flushing these windows.
        with self._lock:
            lines = self._warning(kind, msg, *args)
        self._say(lines)

    def _warning(self, kind: str, msg: str, *args: object) -> list[tuple[str, tuple[object, ...]]]:
        now = self._clock()
        lines: list[tuple[str, tuple[object, ...]]] = []
        window = self._kinds.get(kind)
        if window is None or now - window.started >= self._window:
            lines += self._close(kind, window)
            window = self._kinds[kind] = _Window(now)
        if window.lines < self._lines:
            window.lines += 1
            lines.append((msg, args))
            return lines
        window.dropped += 1
        window.last = (msg, args)  # formatted only if it is the last when the window closes
        return lines

    def flush(self, *, all_windows: bool = False) -> None:
        """Say what the windows that have ended (or, at exit, all) dropped; called now and then, e.g. every scan."""
        with self._lock:
            lines = self._flush(all_windows)
        self._say(lines)

    def _flush(self, all_windows: bool) -> list[tuple[str, tuple[object, ...]]]:
        now = self._clock()
        lines: list[tuple[str, tuple[object, ...]]] = []
        for kind, window in list(self._kinds.items()):
            if all_windows or now - window.started >= self._window:
                lines += self._close(kind, window)
                del self._kinds[kind]
        return lines

    def _close(self, kind: str, window: _Window | None) -> list[tuple[str, tuple[object, ...]]]:
        if window is None or not window.dropped:
            return []
        msg, args = window.last
        return [("%d more '%s' lines in the last %.0f s were not logged (the last: %s)",
                 (window.dropped, kind, min(self._window, self._clock() - window.started),
                  (msg % args if args else msg)[:300]))]

    def _say(self, lines: list[tuple[str, tuple[object, ...]]]) -> None:
        for msg, args in lines:
            self._log.warning(msg, *args)
