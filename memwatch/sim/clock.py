"""The simulator's clock: virtual nanoseconds that advance only when the engine says work was done.

Every rank's Monitor reads the same clock (``clock=clock.now_ns``), so the timestamps of a simulated run
look like a real run's while the run itself takes wall-clock seconds.
"""

from __future__ import annotations

NS_PER_S = 1_000_000_000


class VirtualClock:
    def __init__(self, start_ns: int) -> None:
        self._now = int(start_ns)
        self.start_ns = self._now

    def now_ns(self) -> int:
        return self._now

    @property
    def elapsed_ns(self) -> int:
        return self._now - self.start_ns

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot run backwards ({seconds} s)")
        self._now += round(seconds * NS_PER_S)

    def advance_to(self, ns: int) -> None:
        """Jump to ``ns`` (idle until then); never moves backwards."""
        self._now = max(self._now, int(ns))
