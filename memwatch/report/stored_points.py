"""One stored rank's serving points up to its out-of-memory, searched through indexes, never loaded whole.

``explain`` asks a few questions of an out-of-memory rank (its last point, the last point where a term
was still low, the first where it had grown, the first of the last window). Each is one indexed query
on the samples (full resolution and rolled-up seconds). When the sidecar stored per-minute ranges of
the searched terms (``serving_minutes``), a search first picks the minutes whose range can hold the
answer and reads only those; without them (a replayed run) it scans the rank's range.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from memwatch.detectors.summary import MINUTE_NS, STARTUP_PHASES, ServingPoint, serving_point
from memwatch.ledger import Ledger
from memwatch.records import Event, Sample
from memwatch.store.window import RAW_SELECT, ROLLED_SELECT, run_key

if TYPE_CHECKING:
    from memwatch.store.db import Database

_SKIP_STARTUP = f"NOT IN ({', '.join(repr(phase) for phase in sorted(STARTUP_PHASES))})"
_TERMS = {
    "non_torch_bytes": "{p}driver_used_bytes - {p}reserved_bytes",
    "cache_slack_bytes": "{p}reserved_bytes - {p}allocated_bytes",
    "allocated_bytes": "{p}allocated_bytes",
}


class StoredPoints:
    """:class:`memwatch.report.points.Points` of one stored rank, from ``first`` up to the OOM at ``until_ns``."""

    def __init__(self, db: Database, run_id: str, rank: int, first: ServingPoint | None, until_ns: int,
                 ledger_events: list[Event], *, use_minutes: bool = True) -> None:
        """``use_minutes`` only when the stored minutes cover the whole run (complete live summaries)."""
        self._db, self._run_id, self._rank = db, run_id, rank
        self._key = run_key(db, run_id)
        self._first = first if first is not None and first.ts_ns <= until_ns else None
        self._until = until_ns
        self._ledger = Ledger()
        for event in ledger_events:
            self._ledger.on_event(event)
        stored = db.execute("SELECT 1 FROM serving_minutes WHERE run_id = ? AND rank = ? LIMIT 1", (run_id, rank))
        self._minutes = use_minutes and stored.fetchone() is not None

    # -- the ledger's forward need at a point ---------------------------------------------------------

    def _rise_until(self, ts_ns: int) -> int | None:
        """The largest step rise from the rank's sizing up to ``ts_ns`` (what the ledger's forward need has
        grown to by then): whole minutes from ``serving_minutes``, the rest from the samples."""
        sizing = self._ledger.sizing
        if sizing is None:
            return None
        low, known = sizing.ts_ns - 1, None
        if self._minutes:
            minute = ts_ns // MINUTE_NS
            low = max(low, minute * MINUTE_NS - 1)
            known = self._db.execute(
                "SELECT max(max_step_rise_bytes) FROM serving_minutes WHERE run_id = ? AND rank = ? AND minute >= ?"
                " AND minute < ?", (self._run_id, self._rank, sizing.ts_ns // MINUTE_NS, minute)).fetchone()[0]
        args = (self._key, self._rank, low, ts_ns)
        found = self._db.execute(
            "SELECT max(peak_bytes - allocated_bytes) FROM sample_rows WHERE run_key = ? AND rank = ? AND ts_ns > ?"
            " AND ts_ns <= ? AND peak_is_step", args).fetchone()[0]
        rolled = self._db.execute(
            "SELECT max(max_step_rise_bytes) FROM sample_seconds WHERE run_key = ? AND rank = ? AND last_ts_ns > ?"
            " AND first_ts_ns <= ?", args).fetchone()[0]
        return max((value for value in (known, found, rolled) if value is not None), default=None)

    def _point(self, row: tuple[Any, ...] | None) -> ServingPoint | None:
        if row is None:
            return None
        sample = Sample.from_row((self._run_id, *row[1:]))
        ledger = copy.copy(self._ledger)
        ledger.saw_step_rise(self._rise_until(sample.ts_ns - 1))
        return serving_point(sample, ledger.on_sample(sample))

    # -- searches ---------------------------------------------------------------------------------------

    def _search(self, condition: str, params: tuple[Any, ...], latest: bool, step_from: int | None = None,
                since_ns: int | None = None, until_ns: int | None = None) -> ServingPoint | None:
        """The earliest (or latest) point meeting ``condition`` ({p} stands for the rolled-up prefix)."""
        if self._first is None or self._key is None:
            return None
        lo = self._first.ts_ns if since_ns is None else max(since_ns, self._first.ts_ns)
        hi = self._until if until_ns is None else min(until_ns, self._until)
        order = "DESC" if latest else "ASC"
        found = []
        for table, columns, ts, prefix, step in (
            ("sample_rows", RAW_SELECT, "ts_ns", "", "step"),
            ("sample_seconds", ROLLED_SELECT, "last_ts_ns", "last_", "last_step"),
        ):
            where = (f"run_key = ? AND rank = ? AND {ts} >= ? AND {ts} <= ?"
                     f" AND ({prefix}phase IS NULL OR {prefix}phase {_SKIP_STARTUP})")
            args: list[Any] = [self._key, self._rank, lo, hi]
            if step_from is not None:
                where += f" AND {step} >= ?"
                args.append(step_from)
            if condition:
                where += " AND " + condition.format(p=prefix)
                args.extend(params)
            sort = "ts_ns" if table == "sample_rows" else "second"
            row = self._db.execute(f"SELECT {ts}, {columns} FROM {table} WHERE {where} ORDER BY {sort} {order} LIMIT 1",
                                   args).fetchone()
            if row is not None:
                found.append(row)
        if not found:
            return None
        best = max(found, key=lambda r: r[0]) if latest else min(found, key=lambda r: r[0])
        return self._point(best)

    def _candidate_minutes(self, bound: str, term: str, compare: str, value: float, latest: bool) -> Iterator[int]:
        """Minutes whose stored range of ``term`` can hold a value ``compare`` ``value``, nearest first."""
        assert self._first is not None
        yield from (minute for (minute,) in self._db.execute(
            f"SELECT minute FROM serving_minutes WHERE run_id = ? AND rank = ? AND minute >= ? AND minute <= ?"
            f" AND {bound}_{term} {compare} ? ORDER BY minute {'DESC' if latest else 'ASC'}",
            (self._run_id, self._rank, self._first.ts_ns // MINUTE_NS, self._until // MINUTE_NS, value)))

    def _search_minutes(self, term: str, compare: str, value: float, latest: bool,
                        step_from: int | None = None) -> ServingPoint | None:
        condition = f"{_TERMS[term]} {compare} ?"
        if not self._minutes:
            return self._search(condition, (value,), latest, step_from)
        bound = "min" if compare == "<=" else "max"
        for minute in self._candidate_minutes(bound, term, compare, value, latest):
            point = self._search(condition, (value,), latest, step_from, minute * MINUTE_NS,
                                 (minute + 1) * MINUTE_NS - 1)
            if point is not None:
                return point
        return None

    def first(self) -> ServingPoint | None:
        return self._first

    def last(self) -> ServingPoint | None:
        return self._search("", (), latest=True)

    def last_at_most(self, term: str, limit: int) -> ServingPoint | None:
        return self._search_minutes(term, "<=", limit, latest=True)

    def first_reaching(self, term: str, from_step: int, threshold: float) -> ServingPoint | None:
        return self._search_minutes(term, ">=", threshold, latest=False, step_from=from_step)

    def first_from_step(self, step: int) -> ServingPoint | None:
        """Steps only grow within a rank: find the last point before ``step`` from the end, then the next one."""
        earlier = self._search("{p}step < ?", (step,), latest=True)
        since = None if earlier is None else earlier.ts_ns + 1
        return self._search("", (), latest=False, step_from=step, since_ns=since)
