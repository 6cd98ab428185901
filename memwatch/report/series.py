"""A rank's timeline as a bounded number of points that keeps every peak: min and max per time bucket.

A run of millions of samples cannot be drawn point by point, and a plain average would hide the one
spike that mattered. A long rank is read through :func:`memwatch.store.window.downsampled` (equal
time buckets in SQL, each with the min and max of every column, rolled-up seconds included), so a plot
that draws a bucket as its min then its max shows every peak and every trough. A rank with few
samples comes back row by row from :func:`memwatch.store.window.window_rows` (a full-resolution sample
has min = max; a rolled-up second keeps its own min and max).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memwatch.store.window import Bucket, downsampled, run_key, window_rows

if TYPE_CHECKING:
    from memwatch.store.db import Database

DEFAULT_BUCKETS = 1500

_COLUMNS = {
    "allocated": "allocated_bytes", "reserved": "reserved_bytes", "used": "driver_used_bytes",
    "free": "driver_free_bytes", "kv_used": "kv_blocks_used", "kv_total": "kv_blocks_total", "peak": "peak_bytes",
}


@dataclass
class Series:
    """Columns of equal length, one entry per bucket (or per stored row when not downsampled)."""

    first_ns: list[int] = field(default_factory=list)
    last_ns: list[int] = field(default_factory=list)
    first_step: list[int | None] = field(default_factory=list)
    last_step: list[int | None] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    allocated_min: list[int | None] = field(default_factory=list)
    allocated_max: list[int | None] = field(default_factory=list)
    reserved_min: list[int | None] = field(default_factory=list)
    reserved_max: list[int | None] = field(default_factory=list)
    used_min: list[int | None] = field(default_factory=list)
    used_max: list[int | None] = field(default_factory=list)
    free_min: list[int | None] = field(default_factory=list)
    free_max: list[int | None] = field(default_factory=list)
    kv_used_min: list[int | None] = field(default_factory=list)
    kv_used_max: list[int | None] = field(default_factory=list)
    kv_total_min: list[int | None] = field(default_factory=list)
    kv_total_max: list[int | None] = field(default_factory=list)
    peak_min: list[int | None] = field(default_factory=list)
    peak_max: list[int | None] = field(default_factory=list)
    downsampled: bool = False

    def __len__(self) -> int:
        return len(self.first_ns)

    @property
    def samples(self) -> int:
        return sum(self.count)

    def _append(self, bucket: Bucket) -> None:
        self.first_ns.append(bucket.first_ts_ns)
        self.last_ns.append(bucket.last_ts_ns)
        self.first_step.append(bucket.first_step)
        self.last_step.append(bucket.last_step)
        self.count.append(bucket.samples)
        for name, column in _COLUMNS.items():
            getattr(self, f"{name}_min").append(bucket.minimum.get(column))
            getattr(self, f"{name}_max").append(bucket.maximum.get(column))


_BOTH = ("allocated_bytes", "reserved_bytes", "driver_used_bytes", "kv_blocks_used")
"""Columns drawn as each bucket's min then max; of the others only one bound is shown (the summary's
least free memory, the largest KV total and allocator peak)."""
_LOWS, _HIGHS = ("driver_free_bytes",), ("kv_blocks_total", "peak_bytes")


def _stored_count(db: Database, key: int, rank: int, limit: int) -> int:
    """The rank's stored rows (full resolution and rolled-up seconds), counted up to ``limit``."""
    counted = 0
    for table in ("sample_rows", "sample_seconds"):
        counted += db.execute(f"SELECT count(*) FROM (SELECT 1 FROM {table} WHERE run_key = ? AND rank = ? LIMIT ?)",
                              (key, rank, limit - counted)).fetchone()[0]
    return counted


def peak_series(db: Database, run_id: str, rank: int, buckets: int = DEFAULT_BUCKETS) -> Series:
    """The rank's timeline in time order, reduced to at most ``buckets`` min/max buckets when longer than 2×."""
    series = Series()
    key = run_key(db, run_id)
    if key is None:
        return series
    if _stored_count(db, key, rank, 2 * buckets + 1) > 2 * buckets:
        series.downsampled = True
        for bucket in downsampled(db, run_id, rank, buckets=buckets, columns=_BOTH, lows=_LOWS, highs=_HIGHS):
            series._append(bucket)
        return series
    for row in window_rows(db, run_id, rank=rank):
        sample, rollup = row.sample, row.rollup
        values = {column: getattr(sample, column) for column in _COLUMNS.values()}
        if rollup is None:
            series._append(Bucket(sample.ts_ns, sample.ts_ns, 1, values, values, sample.step, sample.step))
        else:
            series._append(Bucket(rollup.first_ts_ns, sample.ts_ns, rollup.samples, rollup.minimum, rollup.maximum,
                                  rollup.first_step, sample.step))
    return series
