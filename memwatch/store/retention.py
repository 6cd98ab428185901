"""Retention that keeps the evidence: recent samples at full resolution, older ones one row per second.

For each run, samples older than :attr:`Retention.full_ns` before the run's latest sample are rolled up
per second per rank into ``sample_seconds`` (count, first/last time and step, and the min, max and
last of every numeric column) and removed from ``sample_rows`` — except the whole seconds within
:attr:`Retention.evidence_ns` of any flag or out-of-memory event of the run, which stay at full
resolution until the run is deleted. The sidecar applies this as it runs; ``memwatch prune``
applies it by hand and reclaims the freed space. Rolling up is idempotent: a second rolled up twice
(rows that arrived late) is merged into the same row.

Two bounds keep the file below a volume's limit. Per-second rows older than :attr:`Retention.rollups_ns`
before the run's latest sample are deleted (a run longer than that keeps only that much history). With
:attr:`Retention.max_db_bytes`, once the pages in use pass it, the samples of the runs not being stored
(oldest first, one rank per pass) are deleted, then the oldest per-second rows of the live runs, then
their oldest evidence windows: a run's ``runs``/``ranks``/``events``/``flags``/``rank_summaries`` rows stay
(``check`` still reads them), and a live run's full-resolution tail and last evidence window are never
dropped. The roll-up window never touches evidence (full-resolution rows); only the cap, once nothing
else is left, takes a live run's older evidence.

Worst case of the file (bytes measured by ``bench/bench_retention.py``; F full-resolution bytes per sample,
R bytes per per-second row, E the evidence seconds of the flags and OOMs): one run of ``ranks`` ranks at
``rate`` steps/s stays under ``ranks * (rate * F * (full + E) + R * rollups)``; with ``max_db_bytes`` the
file stays under ``max(max_db_bytes, sum over live runs of ranks * rate * F * (full + 2 * evidence + 1 s)) +
ranks * rate * F * 30 s`` (one retention interval's inflow) plus the WAL, which grows to the largest pass (one
rank of a run: ``rate * F * full``, 42 MB at 100 steps/s and 1 h).
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
DEFAULT_ROLLUPS_NS = 2 * 86400 * NS
"""Per-second rows for the last two days of every run: with 8 ranks at 100 steps/s the file stays near 0.9 GB
(a 1 h full window and two days of per-second rows), under the sidecar shape's 2Gi volume with room for evidence."""
LIVE_TRIM_FRACTION = 0.1
"""Over the size cap with only live runs left, each pass drops this share of their oldest per-second rows."""


@dataclass(frozen=True)
class Retention:
    """How much of each run stays at full resolution."""

    full_ns: int = DEFAULT_FULL_NS
    evidence_ns: int = DEFAULT_EVIDENCE_NS
    rollups_ns: int | None = DEFAULT_ROLLUPS_NS
    """Per-second rows kept this long before a run's latest sample (None: for ever)."""
    max_db_bytes: int | None = None
    """Pages in use past which other runs' samples, then live runs' oldest per-second rows, go (None: no cap)."""

    def __post_init__(self) -> None:
        if self.full_ns <= 0 or self.evidence_ns < 0:
            raise UsageError("retention windows must be positive; e.g. --keep-full 1h --keep-evidence 2m")
        if self.rollups_ns is not None and self.rollups_ns <= 0:
            raise UsageError("--keep-rollups must be positive (e.g. 2d), or 'forever'")
        if self.max_db_bytes is not None and self.max_db_bytes <= 0:
            raise UsageError("--max-db-size must be positive (e.g. 1500M), or 0 for no cap")
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
    statements: list[tuple[str, tuple[int, ...]]] = []
    for rank, (first, _last) in sorted(spans.items()):
        for lo, hi in _subtract(first // NS, cutoff_second, kept):
            params = (key, rank, lo * NS, hi * NS)
            statements.append((ROLLUP, params))
            statements.append((DELETE, params))
    if retention.rollups_ns is not None:
        oldest_second = (newest - retention.rollups_ns) // NS
        statements += [(DROP_SECONDS, (key, rank, oldest_second)) for rank in sorted(spans)]
    return statements


DROP_SECONDS = "DELETE FROM sample_seconds WHERE run_key = ?1 AND rank = ?2 AND second < ?3"
"""Per-second rows of one rank older than a second (the roll-up window, or the size cap's trim)."""
DROP_RANK_ROWS = "DELETE FROM sample_rows WHERE run_key = ?1 AND rank = ?2"
DROP_RANK_SECONDS = "DELETE FROM sample_seconds WHERE run_key = ?1 AND rank = ?2"


def used_bytes(db: Database) -> int:
    """Bytes of the pages in use (the file less its free pages; the WAL's newer pages included)."""
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    free = db.execute("PRAGMA freelist_count").fetchone()[0]
    size = db.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)


def plan_size_cap(db: Database, retention: Retention, live: set[str]) -> list[tuple[str, tuple[int, ...]]]:
    """Statements that bring the pages in use toward :attr:`Retention.max_db_bytes`, one step per pass.

    First the samples of the oldest run not in ``live`` (one rank), then a share of the live runs' oldest
    per-second rows, then their oldest evidence windows; never a live run's full-resolution tail nor its last
    evidence window.
    """
    cap = retention.max_db_bytes
    if cap is None or used_bytes(db) <= cap:
        return []
    for key, run_id in db.execute("SELECT run_key, run_id FROM runs ORDER BY started_ns, run_key").fetchall():
        if run_id in live or key is None:
            continue
        rank = (db.execute("SELECT rank FROM sample_rows WHERE run_key = ? LIMIT 1", (key,)).fetchone()
                or db.execute("SELECT rank FROM sample_seconds WHERE run_key = ? LIMIT 1", (key,)).fetchone())
        if rank is not None:
            return [(DROP_RANK_ROWS, (key, rank[0])), (DROP_RANK_SECONDS, (key, rank[0]))]
    keys = {run_id: row[0] for run_id in sorted(live)
            if (row := db.execute("SELECT run_key FROM runs WHERE run_id = ?", (run_id,)).fetchone()) and row[0]}
    statements = []
    for key in keys.values():
        for rank, first, last in db.execute("SELECT rank, min(second), max(second) FROM sample_seconds"
                                            " WHERE run_key = ? GROUP BY rank", (key,)).fetchall():
            cut = first + max(60, int((last - first + 1) * LIVE_TRIM_FRACTION))
            statements.append((DROP_SECONDS, (key, rank, cut)))
    if statements:
        return statements
    for run_id, key in keys.items():
        statements += _oldest_evidence(db, run_id, key, retention)
    return statements


def _oldest_evidence(db: Database, run_id: str, key: int, retention: Retention) -> list[tuple[str, tuple[int, ...]]]:
    """The full-resolution rows of a live run's oldest evidence window behind its full-resolution tail, unless it is
    the run's last one: what the size cap takes once nothing else is left."""
    newest = db.execute("SELECT max(ts_ns) FROM sample_rows WHERE run_key = ?", (key,)).fetchone()[0]
    if newest is None:
        return []
    cutoff_second = (newest - retention.full_ns) // NS
    for lo, hi in evidence_seconds(db, run_id, retention.evidence_ns)[:-1]:  # the last one stays
        if hi >= cutoff_second:
            break
        ranks = [rank for (rank,) in db.execute("SELECT rank FROM ranks WHERE run_id = ?", (run_id,))
                 if db.execute("SELECT 1 FROM sample_rows WHERE run_key = ? AND rank = ? AND ts_ns >= ? AND ts_ns < ?"
                               " LIMIT 1", (key, rank, lo * NS, (hi + 1) * NS)).fetchone()]
        if ranks:  # a window already taken has no rows left: the next one
            return [(DELETE, (key, rank, lo * NS, (hi + 1) * NS)) for rank in ranks]
    return []


def apply_retention(
    db: Database, retention: Retention | None = None, run_ids: list[str] | None = None
) -> PruneResult:
    """Apply ``retention`` to the given runs (all when ``None``) on a writable connection, one run per commit."""
    retention = retention or Retention()
    if run_ids is None:
        run_ids = [run_id for (run_id,) in db.execute("SELECT run_id FROM runs ORDER BY run_key")]
    result = PruneResult()
    conn = db.conn
    live = {run_id for (run_id,) in db.execute("SELECT run_id FROM runs WHERE status = 'running'")}
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
    while statements := plan_size_cap(db, retention, live):  # each step frees something, or there is none left
        with conn:
            freed = sum(conn.execute(sql, params).rowcount for sql, params in statements)
        if not freed:
            break
    return result
