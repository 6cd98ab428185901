"""The attach sampling loop: poll a source on a fixed beat, for a while or until the process ends.

Ticks are scheduled from the start time (tick ``k`` at ``start + k * interval``) so sampling does not
drift; a poll slower than the interval skips the ticks it overran rather than bunching samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

from .snapshot import Snapshot, Source

_TOLERANCE_S = 1e-9
"""Float slack, so that ``--duration 0.3 --interval 0.1`` includes the tick at 0.3 s."""


def watch(
    source: Source,
    *,
    interval_s: float,
    duration_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[Snapshot]:
    """Snapshots at 0, ``interval_s``, 2 × ``interval_s``, … up to and including ``duration_s``.

    Without ``duration_s`` it runs until the process ends, when ``source.poll`` raises
    :class:`memwatch.attach.hostinfo.ProcessExited` (which propagates to the caller).
    """
    if interval_s <= 0:
        raise ValueError("interval_s must be positive")
    start = clock()
    tick = 0
    while True:
        yield source.poll()
        elapsed = clock() - start
        tick = max(tick + 1, math.ceil(elapsed / interval_s - _TOLERANCE_S))
        due = tick * interval_s
        if duration_s is not None and due > duration_s + _TOLERANCE_S:
            return
        sleep(max(0.0, due - elapsed))
