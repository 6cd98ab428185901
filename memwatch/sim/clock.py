"""The simulator's clock: virtual nanoseconds that advance only when the engine says work was done.

Every rank's Monitor reads the same clock (``clock=clock.now_ns``), so the timestamps of a simulated run
look like a real run's while the run itself takes wall-clock seconds.
"""

from __future__ import annotations

import time

NS_PER_S = 1_000_000_000


class VirtualClock:
    """Virtual time; with ``speed`` set, it also takes ``1/speed`` wall seconds per virtual second.

    Pacing lets a person (or a test) watch a simulated run live, e.g. with ``memwatch attach``.
    """

    def __init__(self, start_ns: int, *, speed: float | None = None) -> None:
        if speed is not None and speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self._now = int(start_ns)
        self.start_ns = self._now
        self._speed = speed

    def now_ns(self) -> int:
        return self._now

    @property
    def elapsed_ns(self) -> int:
        return self._now - self.start_ns

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot run backwards ({seconds} s)")
        self._now += round(seconds * NS_PER_S)
        if self._speed is not None:
            time.sleep(seconds / self._speed)

    def advance_to(self, ns: int) -> None:
        """Jump to ``ns`` (idle until then); never moves backwards."""
        if ns > self._now:
            delta, self._now = ns - self._now, int(ns)
            if self._speed is not None:
                time.sleep(delta / NS_PER_S / self._speed)
