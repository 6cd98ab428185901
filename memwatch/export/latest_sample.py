"""The newest sample of a ring, read without draining it: what the headroom gauges show between drains.

Why: the sidecar drains a ring when it holds a batch (about once a second at 1,000 steps/s, up to
every two seconds under a light load: :mod:`memwatch.sidecar.pacing`), which suits the store and the
detectors but would leave a router's signal a second behind the engine. A scrape instead reads the
ring's ``published`` count and its last few slots (``pread`` calls on a descriptor of its own), so the
KV view and the load it exports are the engine's last step's. It never moves the collector's cursor
and never maps the file.

A slot the writer may be overwriting while it is copied is not taken: after the copy, ``published`` is read
again and any slot within reach of the writer since then is dropped (the rules of :mod:`memwatch_engine.ring_format`).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from typing import NamedTuple

from memwatch_engine.ring_format import (
    _PUBLISHED,
    _PUBLISHED_AT,
    _SAMPLE_SLOT,
    HEADER_SIZE,
    MAX_EVENT_CHUNKS,
    RECORD_SIZE,
    TYPE_SAMPLE,
    sample_load,
)

LOOK_BACK = 16
"""Slots read behind ``published`` for the newest sample (events between steps are rarely more)."""

KV_USED, KV_TOTAL = 13, 14
"""Where a sample tuple holds the KV blocks used and the total (``SAMPLE_FIELDS``)."""


class Latest(NamedTuple):
    """The newest sample seen, as far as the headroom needs it (``None``: the engine did not say)."""

    seq: int
    kv_used: int | None
    kv_total: int | None
    running: int | None
    waiting: int | None
    needed: int | None


def _known(value: int) -> int | None:
    return value if value >= 0 else None


class LatestSample:
    """Reads one ring's newest sample on demand, on a descriptor it owns (a ``dup`` of the collector's)."""

    def __init__(self, fd: int, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._fd = os.dup(fd)
        self._mask = capacity - 1
        self._window = capacity - min(MAX_EVENT_CHUNKS, capacity // 8)
        self._clock = clock
        self._published = -1
        self.seen_at: float | None = None
        """The sidecar's clock when ``published`` was last seen to move: when the engine last wrote."""

    def read(self) -> Latest | None:
        """The newest sample with its load among the last :data:`LOOK_BACK` slots, or ``None`` (none there, a
        copy the writer overtook, a ring that is gone); updates :attr:`seen_at`."""
        if self._fd < 0:
            return None
        try:
            published = _PUBLISHED.unpack(os.pread(self._fd, 8, _PUBLISHED_AT))[0]
            if published != self._published:
                self._published, self.seen_at = published, self._clock()
            count = min(published, LOOK_BACK)
            if count == 0:
                return None
            start = published - count
            blob = self._copy(start, count)
            after = _PUBLISHED.unpack(os.pread(self._fd, 8, _PUBLISHED_AT))[0]
        except (OSError, struct.error):  # a ring closed or truncated under us
            return None
        safe_from = after - self._window
        for at in range(len(blob) // RECORD_SIZE - 1, -1, -1):
            seq = start + at
            if seq < safe_from:
                return None
            if blob[at * RECORD_SIZE + 8] != TYPE_SAMPLE:
                continue
            fields = _SAMPLE_SLOT.unpack_from(blob, at * RECORD_SIZE)
            if fields[0] != seq:
                return None  # overwritten while copied
            load = sample_load(blob, at)
            if load is None:
                continue  # a writer that does not record the load
            running, waiting, needed = load
            return Latest(seq, _known(fields[KV_USED]), _known(fields[KV_TOTAL]), _known(running), _known(waiting),
                          _known(needed))
        return None

    def _copy(self, start: int, count: int) -> bytes:
        first = start & self._mask
        tail = self._mask + 1 - first
        if count <= tail:
            return os.pread(self._fd, count * RECORD_SIZE, HEADER_SIZE + first * RECORD_SIZE)
        return (os.pread(self._fd, tail * RECORD_SIZE, HEADER_SIZE + first * RECORD_SIZE)
                + os.pread(self._fd, (count - tail) * RECORD_SIZE, HEADER_SIZE))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass
