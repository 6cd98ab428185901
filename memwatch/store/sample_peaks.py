"""The largest allocator peak of a rank from a moment on, read from the stored samples through their index.

A drawn series cannot answer it once downsampled: a bucket spans the moment, and keeping it would count what came
before, dropping it what came after (``report --json``'s 50 buckets lost the serve phase's first peak so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .window import run_key

if TYPE_CHECKING:
    from .db import Database


def peak_since(db: Database, run_id: str, rank: int, since_ns: int) -> int | None:
    """The rank's largest allocator peak stamped at or after ``since_ns``: its full-resolution rows through the
    samples' index, and each rolled-up second that ends then or later (a second is kept whole)."""
    key = run_key(db, run_id)
    if key is None:
        return None
    rows = """SELECT max(peak_bytes) FROM sample_rows WHERE run_key = ? AND rank = ? AND ts_ns >= ?"""
    seconds = """SELECT max(max_peak_bytes) FROM sample_seconds WHERE run_key = ? AND rank = ? AND last_ts_ns >= ?"""
    found = [db.execute(sql, (key, rank, since_ns)).fetchone()[0] for sql in (rows, seconds)]
    return max((peak for peak in found if peak is not None), default=None)
