"""Retention that keeps the evidence: recent samples at full resolution, older ones one row per second.

For each run, samples older than :attr:`Retention.full_ns` before the run's latest sample are rolled up
per second per rank into ``sample_seconds`` (count, first/last time and step, and the min, max and
last of every numeric column) and removed from ``sample_rows`` — except the whole seconds within
:attr:`Retention.evidence_ns` of any flag or out-of-memory event of the run, which stay at full
resolution until the run is deleted. The sidecar applies this as it runs; ``memwatch prune``
applies it by hand and reclaims the freed space. Rolling up is idempotent: a second rolled up twice
(rows that arrived late) is merged into the same row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UsageError
from .schema import ROLLUP_COLUMNS

if TYPE_CHECKING:
    from memwatch.store.db import Database

NS = 1_000_000_000
DEFAULT_FULL_NS = 3600 * NS
"""Full resolution for the last hour of every run."""
DEFAULT_EVIDENCE_NS = 120 * NS
"""Two minutes either side of every flag and out-of-memory."""


@dataclass(frozen=True)
class Retention:
    """How much of each run stays at full resolution."""

    full_ns: int = DEFAULT_FULL_NS
    evidence_ns: int = DEFAULT_EVIDENCE_NS

    def __post_init__(self) -> None:
        if self.full_ns <= 0 or self.evidence_ns < 0:
            raise UsageError("retention windows must be positive; e.g. --keep-full 1h --keep-evidence 2m")
        if self.evidence_ns >= self.full_ns:
            raise UsageError("--keep-evidence must be shorter than --keep-full, so that a new flag's window is still "
                             "at full resolution when it is raised")


@dataclass
class PruneResult:
    runs: int = 0
    rolled_samples: int = 0
    """Full-resolution samples folded into per-second rows (and removed)."""


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def evidence_seconds(db: Database, run_id: str, evidence_ns: int) -> list[tuple[int, int]]:
    """Whole seconds (first, last, inclusive) kept at full resolution around the run's flags and OOMs."""
    moments = db.execute(
        "SELECT ts_ns FROM flags WHERE run_id = ? UNION SELECT ts_ns FROM events WHERE run_id = ? AND kind = 'oom'",
        (run_id, run_id),
    ).fetchall()
    return _merge([((ts - evidence_ns) // NS, (ts + evidence_ns) // NS) for (ts,) in moments if ts is not None])


def _subtract(lo: int, hi: int, kept: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Seconds in [lo, hi) outside the kept ranges, as half-open [a, b) ranges."""
    free, cursor = [], lo
    for first, last in kept:
        if last < cursor or first >= hi:
            continue
        if first > cursor:
            free.append((cursor, first))
        cursor = max(cursor, last + 1)
    if cursor < hi:
        free.append((cursor, hi))
    return free


def _on_conflict() -> str:
    updates = [
        "samples = samples + excluded.samples",
        "first_ts_ns = min(first_ts_ns, excluded.first_ts_ns)",
        "first_step = min(first_step, excluded.first_step)",
    ]
    later = "excluded.last_ts_ns >= last_ts_ns"
    for column in ("last_step", "last_phase", "last_step_kind", *(f"last_{c}" for c in ROLLUP_COLUMNS)):
        updates.append(f"{column} = CASE WHEN {later} THEN excluded.{column} ELSE {column} END")
    updates.append(f"last_ts_ns = CASE WHEN {later} THEN excluded.last_ts_ns ELSE last_ts_ns END")
    updates.append("max_step_rise_bytes = coalesce(max(max_step_rise_bytes, excluded.max_step_rise_bytes),"
                   " max_step_rise_bytes, excluded.max_step_rise_bytes)")
    for c in ROLLUP_COLUMNS:
        updates.append(f"min_{c} = coalesce(min(min_{c}, excluded.min_{c}), min_{c}, excluded.min_{c})")
        updates.append(f"max_{c} = coalesce(max(max_{c}, excluded.max_{c}), max_{c}, excluded.max_{c})")
    return " ON CONFLICT (run_key, rank, second) DO UPDATE SET " + ", ".join(updates)


_BOUNDS = ", ".join(f"min({c}) AS min_{c}, max({c}) AS max_{c}" for c in ROLLUP_COLUMNS)
ROLLUP = (
    "INSERT INTO sample_seconds (run_key, rank, second, samples, first_ts_ns, last_ts_ns, first_step, last_step,"
    " last_phase, last_step_kind, max_step_rise_bytes, "
    + ", ".join(f"min_{c}, max_{c}, last_{c}" for c in ROLLUP_COLUMNS) + ")"
    " SELECT g.run_key, g.rank, g.second, g.n, g.t0, g.t1, g.s0, l.step, l.phase, l.step_kind, g.rise, "
    + ", ".join(f"g.min_{c}, g.max_{c}, l.{c}" for c in ROLLUP_COLUMNS)
    + " FROM (SELECT run_key, rank, ts_ns / 1000000000 AS second, count(*) AS n, min(ts_ns) AS t0, max(ts_ns) AS t1,"
    " min(step) AS s0, max(CASE WHEN peak_is_step THEN peak_bytes - allocated_bytes END)"
    f" AS rise, {_BOUNDS} FROM sample_rows"
    " WHERE run_key = ?1 AND rank = ?2 AND ts_ns >= ?3 AND ts_ns < ?4 GROUP BY second) g"
    " JOIN sample_rows l ON l.run_key = g.run_key AND l.rank = g.rank AND l.ts_ns = g.t1 AND l.seq ="
    " (SELECT max(seq) FROM sample_rows m WHERE m.run_key = g.run_key AND m.rank = g.rank AND m.ts_ns = g.t1)"
    " WHERE 1" + _on_conflict()
)
"""Fold one rank's samples in [?3, ?4) ns into per-second rows (the last sample: latest time, then seq)."""
DELETE = "DELETE FROM sample_rows WHERE run_key = ?1 AND rank = ?2 AND ts_ns >= ?3 AND ts_ns < ?4"


def plan_run(db: Database, run_id: str, retention: Retention) -> list[tuple[str, tuple[int, ...]]]:
    """The statements that apply ``retention`` to one run (run them in one transaction, in order)."""
    row = db.execute("SELECT run_key FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    if row is None or row[0] is None:
        return []
    key = row[0]
    ranks = [rank for (rank,) in db.execute("SELECT rank FROM ranks WHERE run_id = ?", (run_id,))] or [
        rank for (rank,) in db.execute("SELECT DISTINCT rank FROM sample_rows WHERE run_key = ?", (key,))
    ]
    spans = {}
    for rank in ranks:  # a lone min() or max() is read from the key's ends; both in one query read every row
        first = db.execute("SELECT min(ts_ns) FROM sample_rows WHERE run_key = ? AND rank = ?", (key, rank)).fetchone()
        if first[0] is not None:
            last = db.execute("SELECT max(ts_ns) FROM sample_rows WHERE run_key = ? AND rank = ?", (key, rank))
            spans[rank] = (first[0], last.fetchone()[0])
    if not spans:
        return []
    newest = max(last for _, last in spans.values())
    cutoff_second = (newest - retention.full_ns) // NS
    kept = evidence_seconds(db, run_id, retention.evidence_ns)
    statements = []
    for rank, (first, _last) in sorted(spans.items()):
        for lo, hi in _subtract(first // NS, cutoff_second, kept):
            params = (key, rank, lo * NS, hi * NS)
            statements.append((ROLLUP, params))
            statements.append((DELETE, params))
    return statements


def apply_retention(
    db: Database, retention: Retention | None = None, run_ids: list[str] | None = None
) -> PruneResult:
    """Apply ``retention`` to the given runs (all when ``None``) on a writable connection, one run per commit."""
    retention = retention or Retention()
    if run_ids is None:
        run_ids = [run_id for (run_id,) in db.execute("SELECT run_id FROM runs ORDER BY run_key")]
    result = PruneResult()
    conn = db.conn
    for run_id in run_ids:
        statements = plan_run(db, run_id, retention)
        if not statements:
            continue
        with conn:
            for sql, params in statements:
                cursor = conn.execute(sql, params)
                if sql is DELETE:
                    result.rolled_samples += cursor.rowcount
        result.runs += 1
    return result
