"""A rank's timeline as a bounded number of points that keeps every peak: min and max per time bucket.

A run of millions of samples cannot be drawn point by point, and a plain average would hide the one
spike that mattered. The samples of a rank are grouped into equal time buckets in SQL (one index
range scan, nothing per row in Python) and each bucket keeps its first and last time and the min
and max of every column, so a plot that draws a bucket as its min then its max shows every peak and
every trough. A rank with few samples comes back sample by sample (min = max).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sqlite_utils

DEFAULT_BUCKETS = 1500


@dataclass
class Series:
    """Columns of equal length, one entry per bucket (or per sample when not downsampled)."""

    first_ns: list[int] = field(default_factory=list)
    last_ns: list[int] = field(default_factory=list)
    first_step: list[int] = field(default_factory=list)
    last_step: list[int] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    allocated_min: list[int | None] = field(default_factory=list)
    allocated_max: list[int | None] = field(default_factory=list)
    reserved_min: list[int | None] = field(default_factory=list)
    reserved_max: list[int | None] = field(default_factory=list)
    used_min: list[int | None] = field(default_factory=list)
    used_max: list[int | None] = field(default_factory=list)
    free_min: list[int | None] = field(default_factory=list)
    kv_used_min: list[int | None] = field(default_factory=list)
    kv_used_max: list[int | None] = field(default_factory=list)
    kv_total_max: list[int | None] = field(default_factory=list)
    step_peak_max: list[int | None] = field(default_factory=list)
    """The largest allocator peak of a step whose peak is its own (``peak_is_step``)."""
    downsampled: bool = False

    def __len__(self) -> int:
        return len(self.first_ns)

    @property
    def samples(self) -> int:
        return sum(self.count)


_AGGREGATES = (
    "min(ts_ns), max(ts_ns), min(step), max(step), count(*), min(allocated_bytes), max(allocated_bytes),"
    " min(reserved_bytes), max(reserved_bytes), min(driver_used_bytes), max(driver_used_bytes),"
    " min(driver_free_bytes), min(kv_blocks_used), max(kv_blocks_used), max(kv_blocks_total),"
    " max(CASE WHEN peak_is_step THEN peak_bytes END)"
)
_RAW = (
    "ts_ns, ts_ns, step, step, 1, allocated_bytes, allocated_bytes, reserved_bytes, reserved_bytes,"
    " driver_used_bytes, driver_used_bytes, driver_free_bytes, kv_blocks_used, kv_blocks_used, kv_blocks_total,"
    " CASE WHEN peak_is_step THEN peak_bytes END"
)


def peak_series(db: sqlite_utils.Database, run_id: str, rank: int, buckets: int = DEFAULT_BUCKETS) -> Series:
    """The rank's samples in time order, reduced to at most ``buckets`` min/max buckets."""
    where = "run_id = ? AND rank = ?"
    first, last, count = db.execute(
        f"SELECT min(ts_ns), max(ts_ns), count(*) FROM samples WHERE {where}", (run_id, rank)
    ).fetchone()
    series = Series()
    if not count:
        return series
    if count <= 2 * buckets or last == first:
        rows = db.execute(f"SELECT {_RAW} FROM samples WHERE {where} ORDER BY ts_ns, rowid", (run_id, rank))
    else:
        width = (last - first) / buckets
        rows = db.execute(
            f"SELECT {_AGGREGATES} FROM samples WHERE {where} GROUP BY CAST((ts_ns - ?) / ? AS INTEGER)"
            " ORDER BY 1", (run_id, rank, first, width),
        )
        series.downsampled = True
    columns = (series.first_ns, series.last_ns, series.first_step, series.last_step, series.count,
               series.allocated_min, series.allocated_max, series.reserved_min, series.reserved_max,
               series.used_min, series.used_max, series.free_min, series.kv_used_min, series.kv_used_max,
               series.kv_total_max, series.step_peak_max)
    for row in rows:
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    return series
