"""Reading part of a run's timeline, whatever retention did to it.

Recent samples are stored at full resolution in ``sample_rows``; older ones may have been rolled up
per second per rank into ``sample_seconds`` (min, max and last of each numeric column). Readers see
one time-ordered stream: a full-resolution sample as it was stored, a rolled-up second as a sample
carrying that second's last values (its step and time are the last sample's) plus its
:class:`Rollup` (how many samples, the minimum and maximum of each column). Both tables are read
through the ``(run_key, rank, ts_ns)`` / ``(run_key, rank, second)`` keys, so a window costs what
is in it, not what the run holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..records import SAMPLE_COLUMNS, Sample
from .schema import ROLLUP_COLUMNS

if TYPE_CHECKING:
    from memwatch.store.db import Database

class Rollup(NamedTuple):
    """What one rolled-up second of one rank held besides its last sample."""

    samples: int
    first_ts_ns: int
    first_step: int | None
    minimum: dict[str, int | None]
    maximum: dict[str, int | None]


class WindowRow(NamedTuple):
    """One row of a timeline window: a sample, and its rollup when it stands for a whole second."""

    sample: Sample
    rollup: Rollup | None


def run_key(db: Database, run_id: str) -> int | None:
    """The integer key a run's samples are stored under (``None`` for an unknown run)."""
    row = db.execute("SELECT run_key FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return None if row is None else row[0]


def stored_ranks(db: Database, key: int) -> list[int]:
    """The ranks a run has samples of (either resolution), one index probe per rank."""
    ranks: set[int] = set()
    for table in ("sample_rows", "sample_seconds"):
        rank = -(1 << 62)
        while (rank := db.execute(f"SELECT min(rank) FROM {table} WHERE run_key = ? AND rank > ?",
                                  (key, rank)).fetchone()[0]) is not None:
            ranks.add(rank)
    return sorted(ranks)


def key_range_where(key: int, rank: int | list[int] | None, since_ns: int | None, until_ns: int | None,
                    ts: str) -> tuple[str, list[Any]]:
    """A ``WHERE`` clause and its parameters for a run's rows of ``rank`` (one, a list, or all) whose time
    column ``ts`` lies between ``since_ns`` and ``until_ns`` inclusive, written so the table's key is used."""
    clauses, params = ["run_key = ?"], [key]
    if isinstance(rank, list):  # every rank listed, so that a time range is an index range per rank
        clauses.append(f"rank IN ({', '.join('?' * len(rank))})")
        params.extend(rank)
    elif rank is not None:
        clauses.append("rank = ?")
        params.append(rank)
    if since_ns is not None:
        clauses.append(f"{ts} >= ?")
        params.append(since_ns)
    if until_ns is not None:
        clauses.append(f"{ts} <= ?")
        params.append(until_ns)
    return " AND ".join(clauses), params


def _rolled_as(column: str) -> str:
    if column in ("rank",):
        return column
    if column in ("step", "ts_ns", "phase", "step_kind") or column in ROLLUP_COLUMNS:
        return f"last_{column}"
    return "0" if column == "peak_is_step" else "NULL"


RAW_SELECT = ", ".join(SAMPLE_COLUMNS[1:])
"""``sample_rows`` columns in :data:`SAMPLE_COLUMNS` order, run id left out."""
ROLLED_SELECT = ", ".join(_rolled_as(column) for column in SAMPLE_COLUMNS[1:])
"""A rolled-up second as a sample (same order): its last values; columns not rolled up (the allocator's
signals) are NULL."""
_EXTRA = ", ".join(f"min_{c}, max_{c}" for c in ROLLUP_COLUMNS)


def window_rows(
    db: Database, run_id: str, *, rank: int | None = None,
    since_ns: int | None = None, until_ns: int | None = None,
) -> Iterator[WindowRow]:
    """The run's timeline between ``since_ns`` and ``until_ns`` (inclusive), in time order, then rank."""
    key = run_key(db, run_id)
    if key is None:
        return
    ranks = stored_ranks(db, key) if rank is None and (since_ns is not None or until_ns is not None) else rank
    raw_where, raw_params = key_range_where(key, ranks, since_ns, until_ns, "ts_ns")
    rolled_where, rolled_params = key_range_where(key, ranks, since_ns, until_ns, "last_ts_ns")
    rolled = db.execute(f"SELECT 1 FROM sample_seconds WHERE {rolled_where} LIMIT 1", rolled_params).fetchone()
    if rolled is None:  # all at full resolution (the usual case for a recent window): no union to pad and sort
        from_row = Sample.from_row
        for row in db.execute(f"SELECT ?, {RAW_SELECT} FROM sample_rows WHERE {raw_where} ORDER BY ts_ns, rank, seq",
                              [run_id, *raw_params]):
            yield WindowRow(from_row(row), None)
        return
    nulls = ", ".join(["NULL"] * (3 + 2 * len(ROLLUP_COLUMNS)))
    sql = (
        f"SELECT {RAW_SELECT}, {nulls} FROM sample_rows WHERE {raw_where}"
        f" UNION ALL SELECT {ROLLED_SELECT}, samples, first_ts_ns, first_step, {_EXTRA}"
        f" FROM sample_seconds WHERE {rolled_where}"
        " ORDER BY 3, 1"
    )
    width = len(SAMPLE_COLUMNS) - 1
    for row in db.execute(sql, [*raw_params, *rolled_params]):
        sample = Sample.from_row((run_id, *row[:width]))
        count = row[width]
        if count is None:
            yield WindowRow(sample, None)
            continue
        bounds = row[width + 3:]
        yield WindowRow(sample, Rollup(
            count, row[width + 1], row[width + 2],
            {c: bounds[2 * i] for i, c in enumerate(ROLLUP_COLUMNS)},
            {c: bounds[2 * i + 1] for i, c in enumerate(ROLLUP_COLUMNS)},
        ))


def window_samples(
    db: Database, run_id: str, *, rank: int | None = None,
    since_ns: int | None = None, until_ns: int | None = None,
) -> Iterator[Sample]:
    """:func:`window_rows` without the rollups: a rolled-up second is its last sample."""
    for row in window_rows(db, run_id, rank=rank, since_ns=since_ns, until_ns=until_ns):
        yield row.sample


def time_span(db: Database, run_id: str, rank: int | None = None) -> tuple[int | None, int | None]:
    """The first and last sample time of the run (or rank), over both resolutions.

    Each bound is its own query per rank: SQLite answers a lone ``min()`` or ``max()`` from the key's
    ends, but reads every row of the range when one query asks for both.
    """
    key = run_key(db, run_id)
    if key is None:
        return None, None
    firsts, lasts = [], []
    for one in stored_ranks(db, key) if rank is None else [rank]:
        for sql, found in (
            ("SELECT ts_ns FROM sample_rows WHERE run_key = ? AND rank = ? ORDER BY ts_ns LIMIT 1", firsts),
            ("SELECT ts_ns FROM sample_rows WHERE run_key = ? AND rank = ? ORDER BY ts_ns DESC LIMIT 1", lasts),
            ("SELECT first_ts_ns FROM sample_seconds WHERE run_key = ? AND rank = ? ORDER BY second LIMIT 1", firsts),
            ("SELECT last_ts_ns FROM sample_seconds WHERE run_key = ? AND rank = ? ORDER BY second DESC LIMIT 1",
             lasts),
        ):
            row = db.execute(sql, (key, one)).fetchone()
            if row is not None and row[0] is not None:
                found.append(row[0])
    return (min(firsts) if firsts else None, max(lasts) if lasts else None)


class Bucket(NamedTuple):
    """One bucket of a downsampled series: its time span, how many samples, and per column min and max."""

    first_ts_ns: int
    last_ts_ns: int
    samples: int
    minimum: dict[str, int | None]
    maximum: dict[str, int | None]
    first_step: int | None = None
    last_step: int | None = None


def downsampled(
    db: Database, run_id: str, rank: int, *, buckets: int = 1000,
    since_ns: int | None = None, until_ns: int | None = None, columns: Sequence[str] = ROLLUP_COLUMNS,
    lows: Sequence[str] = (), highs: Sequence[str] = (),
) -> list[Bucket]:
    """One rank's series cut into at most ``buckets`` equal time buckets, each keeping its min and max.

    Every peak and trough survives (a bucket's min/max span every sample in it, rolled-up seconds
    included), so a plot of millions of samples drawn from a thousand buckets hides nothing. ``columns``
    get both bounds; ``lows`` only their minimum and ``highs`` only their maximum (each bound costs a
    step per sample read, and reading every sample is what a long run's downsampling costs).
    """
    wanted = [*(("min", c) for c in columns), *(("max", c) for c in columns), *(("min", c) for c in lows),
              *(("max", c) for c in highs)]
    for _, column in wanted:
        if column not in ROLLUP_COLUMNS:
            raise ValueError(f"{column!r} is not a numeric sample column; choose from {', '.join(ROLLUP_COLUMNS)}")
    key = run_key(db, run_id)
    first, last = time_span(db, run_id, rank)
    if key is None or first is None or last is None:
        return []
    lo = first if since_ns is None else max(first, since_ns)
    hi = last if until_ns is None else min(last, until_ns)
    if hi < lo:
        return []
    width = max(1, -(-(hi - lo + 1) // max(1, buckets)))
    # One index range read per bucket: a GROUP BY over a computed bucket number would sort every row first.
    bounds = ", ".join(f"{fold}({c})" for fold, c in wanted)
    raw_sql = (f"SELECT count(*), min(ts_ns), max(ts_ns), min(step), max(step), {bounds} FROM sample_rows"
               " WHERE run_key = ? AND rank = ? AND ts_ns >= ? AND ts_ns < ?")
    rolled_bounds = ", ".join(f"{fold}({fold}_{c})" for fold, c in wanted)
    rolled_sql = (f"SELECT sum(samples), min(first_ts_ns), max(last_ts_ns), min(first_step), max(last_step),"
                  f" {rolled_bounds} FROM sample_seconds WHERE run_key = ? AND rank = ? AND last_ts_ns >= ?"
                  " AND last_ts_ns < ?")
    rolled = db.execute("SELECT 1 FROM sample_seconds WHERE run_key = ? AND rank = ? AND last_ts_ns >= ?"
                        " AND last_ts_ns <= ? LIMIT 1", (key, rank, lo, hi)).fetchone() is not None
    raw = db.conn.cursor()
    result = []
    for start in range(lo, hi + 1, width):
        end = min(start + width, hi + 1)
        row = raw.execute(raw_sql, (key, rank, start, end)).fetchone()
        if not rolled:  # the usual case: one part, nothing to merge
            if row[0]:
                result.append(Bucket(row[1], row[2], row[0], *_bounds(row[5:], wanted), row[3], row[4]))
            continue
        parts = [part for part in (row, db.execute(rolled_sql, (key, rank, start, end)).fetchone()) if part[0]]
        if parts:
            result.append(_merge(parts, wanted))
    return result


def _bounds(values: Sequence[Any], wanted: list[tuple[str, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    low: dict[str, Any] = {}
    high: dict[str, Any] = {}
    for (fold, column), value in zip(wanted, values, strict=True):
        (low if fold == "min" else high)[column] = value
    return low, high


def _merge(parts: list[tuple[Any, ...]], wanted: list[tuple[str, str]]) -> Bucket:
    """One bucket from its full-resolution and rolled-up aggregates (count, times, steps, then ``wanted``)."""

    def pick(index: int, fold: Any) -> Any:
        values = [part[index] for part in parts if part[index] is not None]
        return fold(values) if values else None

    folded = [pick(5 + i, min if fold == "min" else max) for i, (fold, _) in enumerate(wanted)]
    return Bucket(pick(1, min), pick(2, max), sum(part[0] for part in parts), *_bounds(folded, wanted),
                  pick(3, min), pick(4, max))
