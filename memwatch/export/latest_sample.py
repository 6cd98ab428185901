"""The newest sample of a ring, read without draining it: what the headroom gauges show between drains.

Why: the sidecar drains a ring when it holds a batch (about once a second at 1,000 steps/s, up to
every two seconds under a light load: :mod:`memwatch.sidecar.pacing`), which suits the store and the
detectors but would leave a router's signal a second behind the engine. A scrape instead reads the
ring's ``published`` count and its last few slots (``pread`` calls on a descriptor of its own), so the
KV view and the load it exports are the engine's last step's. It never moves the collector's cursor
and never maps the file.

A slot the writer may be overwriting while it is copied is not taken: after the copy, ``published`` is read
again and any slot within reach of the writer since then is dropped (the rules of :mod:`memwatch_engine.ring_format`).

When the engine last wrote is its newest record's own timestamp (``ts_ns``, the engine host's wall clock), not
when a scrape first saw the ring move: a scrape that comes 50 ms after a write reads an age of 50 ms. A
timestamp ahead of the sidecar's clock (an engine on a simulated clock) counts as written now.
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
    HEADER_SIZE,
    MAX_EVENT_CHUNKS,
    RECORD_SIZE,
    SAMPLE_HAS_LOAD,
    TYPE_SAMPLE,
)

LOOK_BACK = 16
"""Slots read behind ``published`` for the newest sample (events between steps are rarely more)."""

_STAMP = struct.Struct("<Q16xq")
"""A record's seq and ``ts_ns`` (bytes 0 and 24 of every slot, sample or event chunk)."""
_PICK = struct.Struct("<QBBxxi64xii32xii")
"""Of a sample slot only what the headroom reads: seq, type, flags, requests running (12), KV blocks used and
total (80), requests waiting and KV blocks needed (120): the layout of :mod:`memwatch_engine.ring_format`."""
assert _PICK.size == RECORD_SIZE


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

    def __init__(self, fd: int, capacity: int, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], int] = time.time_ns) -> None:
        self._fd = os.dup(fd)
        self._mask = capacity - 1
        self._window = capacity - min(MAX_EVENT_CHUNKS, capacity // 8)
        self._clock = clock
        self._wall = wall
        self._published = -1
        self._latest: Latest | None = None
        self.seen_at: float | None = None
        """When the engine last wrote, on the sidecar's clock (``clock``): its newest record's timestamp."""

    def _written_at(self, stamp: bytes, published: int) -> float:
        """The sidecar's ``clock`` at the newest record's ``ts_ns``; now when its slot was overwritten meanwhile
        or its stamp is ahead of this host's wall clock."""
        now = self._clock()
        seq, ts_ns = _STAMP.unpack_from(stamp)
        if seq != published - 1:
            return now
        return now - max(self._wall() - ts_ns, 0) / 1e9

    def _slot_at(self, seq: int) -> int:
        return HEADER_SIZE + (seq & self._mask) * RECORD_SIZE

    def moved(self) -> None:
        """Only look whether the ring's count moved, and when its newest record was written (two ``pread``
        calls): for a rank that reports no KV view or load."""
        if self._fd < 0:
            return
        try:
            published = _PUBLISHED.unpack(os.pread(self._fd, 8, _PUBLISHED_AT))[0]
            if published == self._published or published < 1:
                return
            stamp = os.pread(self._fd, _STAMP.size, self._slot_at(published - 1))
        except (OSError, struct.error):
            return
        if len(stamp) == _STAMP.size:
            self._published, self.seen_at = published, self._written_at(stamp, published)

    def read(self) -> Latest | None:
        """The newest sample with its load among the last :data:`LOOK_BACK` slots, or ``None`` (none there, a
        copy the writer overtook, a ring that is gone); updates :attr:`seen_at`."""
        fd = self._fd
        if fd < 0:
            return None
        try:
            published = _PUBLISHED.unpack(os.pread(fd, 8, _PUBLISHED_AT))[0]
            if published == self._published:
                return self._latest  # nothing written since the last look
            self._published, self.seen_at = published, self._clock()
            count = min(published, LOOK_BACK)
            start = published - count
            first = start & self._mask
            if count <= self._mask + 1 - first:
                blob = os.pread(fd, count * RECORD_SIZE, HEADER_SIZE + first * RECORD_SIZE)
            else:
                tail = self._mask + 1 - first
                blob = (os.pread(fd, tail * RECORD_SIZE, HEADER_SIZE + first * RECORD_SIZE)
                        + os.pread(fd, (count - tail) * RECORD_SIZE, HEADER_SIZE))
            after = _PUBLISHED.unpack(os.pread(fd, 8, _PUBLISHED_AT))[0]
        except (OSError, struct.error):  # a ring closed or truncated under us
            return None
        safe_from = after - self._window
        newest = (count - 1) * RECORD_SIZE
        if count and published - 1 >= safe_from:
            self.seen_at = self._written_at(blob[newest:newest + _STAMP.size], published)
        self._latest = None
        for at in range(len(blob) // RECORD_SIZE - 1, -1, -1):
            seq = start + at
            if seq < safe_from:
                break
            slot_seq, kind, flags, running, kv_used, kv_total, waiting, needed = _PICK.unpack_from(
                blob, at * RECORD_SIZE)
            if kind != TYPE_SAMPLE or not flags & SAMPLE_HAS_LOAD:
                continue  # an event's chunk, or a reading without the load (between steps)
            if slot_seq != seq:
                break  # overwritten while copied
            self._latest = Latest(seq, _known(kv_used), _known(kv_total), _known(running), _known(waiting),
                                  _known(needed))
            break
        return self._latest

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass
