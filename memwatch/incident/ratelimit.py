"""How many incident bundles one engine uid may cause: a token bucket per uid.

A trusted uid that ends 40 short runs in ``error`` would otherwise get 40 bundles in seconds; each uid may have
:data:`PER_HOUR` bundles at once (a burst), then one more each ``3600 / PER_HOUR`` seconds. A run whose uid is not
known (its ring was never seen by this sidecar: decided before a restart) counts against the uid ``None``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PER_HOUR = 10


class PerUid:
    """``allow(uid)``: whether one more bundle may be built for ``uid`` now (taking its token if so)."""

    def __init__(self, per_hour: int = PER_HOUR, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_hour = per_hour
        self._clock = clock
        self._buckets: dict[int | None, tuple[float, float]] = {}
        """uid → (tokens, when counted)."""

    def allow(self, uid: int | None) -> bool:
        if self.per_hour <= 0:
            return True  # no limit
        now = self._clock()
        tokens, then = self._buckets.get(uid, (float(self.per_hour), now))
        tokens = min(float(self.per_hour), tokens + (now - then) * self.per_hour / 3600.0)
        if tokens < 1.0:
            self._buckets[uid] = (tokens, now)
            return False
        self._buckets[uid] = (tokens - 1.0, now)
        if len(self._buckets) > 4096:  # bounded: the fullest buckets are the ones worth forgetting
            del self._buckets[max(self._buckets, key=lambda key: self._buckets[key][0])]
        return True
