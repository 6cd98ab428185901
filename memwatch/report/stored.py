"""A stored run as check and explain read it: summaries and flags, and indexed searches of its samples.

When the sidecar stored complete summaries with the same thresholds, reading a run costs a few
rows whatever its length. Otherwise the run is replayed through the detectors as a stream
(memory stays bounded; time grows with the run). ``explain`` then looks at an out-of-memory rank
through :class:`StoredPoints`, a handful of indexed queries instead of loading the rank.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memwatch.detectors import DetectorConfig, interleave, replay
from memwatch.detectors.summary import STARTUP_PHASES, RankSummary, ServingPoint, serving_point
from memwatch.flags import OOM, Flag
from memwatch.ledger import KV_ALLOCATED, PHASE_END, WEIGHTS_LOADED, Ledger
from memwatch.records import Event, Sample
from memwatch.report.readings import WINDOW_STEPS, RankReadings
from memwatch.store.queries import Run, events, get_run, samples
from memwatch.store.summaries import load_summaries, stored_flags
from memwatch.store.window import RAW_SELECT, ROLLED_SELECT, run_key

if TYPE_CHECKING:
    from memwatch.store.db import Database


def stored_records(db: Database, ref: str) -> tuple[Run, list[Sample | Event]]:
    """The run ``ref`` (id, unique prefix or ``latest``) and its records, events first at equal times."""
    run = get_run(db, ref)
    return run, list(interleave(samples(db, run.run_id), events(db, run.run_id)))


@dataclass
class StoredRun:
    run: Run
    summaries: dict[int, RankSummary]
    flags: list[Flag]
    from_summaries: bool
    """True when read from the sidecar's stored summaries, False when replayed."""


def stored_run(db: Database, ref: str, config: DetectorConfig | None = None) -> StoredRun:
    """The run's per-rank summaries and flags: stored ones when complete, else a streamed replay."""
    run = get_run(db, ref)
    summaries = load_summaries(db, run.run_id, config)
    if summaries is not None:
        return StoredRun(run, summaries, stored_flags(db, run.run_id), True)
    replayed = replay(interleave(samples(db, run.run_id), events(db, run.run_id)), config)
    return StoredRun(run, replayed.ranks, replayed.flags, False)


_SKIP_STARTUP = f"NOT IN ({', '.join(repr(phase) for phase in sorted(STARTUP_PHASES))})"
_TERMS = {
    "non_torch_bytes": "{p}driver_used_bytes - {p}reserved_bytes",
    "cache_slack_bytes": "{p}reserved_bytes - {p}allocated_bytes",
    "allocated_bytes": "{p}allocated_bytes",
}
class StoredPoints:
    """:class:`memwatch.report.explain.Points` of one stored rank, from ``first`` up to the OOM at ``until_ns``."""

    def __init__(self, db: Database, run_id: str, rank: int, first: ServingPoint | None,
                 until_ns: int) -> None:
        self._db, self._run_id, self._rank = db, run_id, rank
        self._key = run_key(db, run_id)
        self._first = first if first is not None and first.ts_ns <= until_ns else None
        self._until = until_ns
        self._ledger = Ledger()
        for event in _events(db, run_id, LEDGER_EVENTS, rank, until_ns):
            self._ledger.on_event(event)
        self._rises: dict[int, int | None] = {}
        """Largest step rise from sizing up to a time, for the times asked so far."""

    def _rise_until(self, ts_ns: int) -> int | None:
        """The largest step rise of the rank's samples from its sizing up to ``ts_ns`` (what the ledger's
        forward need has grown to by then), scanning only from the nearest time already asked."""
        sizing = self._ledger.sizing
        if sizing is None:
            return None
        if ts_ns in self._rises:
            return self._rises[ts_ns]
        earlier = [t for t in self._rises if t < ts_ns]
        start = max(earlier) if earlier else None
        low, known = (start, self._rises[start]) if start is not None else (sizing.ts_ns - 1, None)
        args = (self._key, self._rank, low, ts_ns)
        found = self._db.execute(
            "SELECT max(peak_bytes - allocated_bytes) FROM sample_rows WHERE run_key = ? AND rank = ? AND ts_ns > ?"
            " AND ts_ns <= ? AND peak_is_step", args).fetchone()[0]
        rolled = self._db.execute(
            "SELECT max(max_step_rise_bytes) FROM sample_seconds WHERE run_key = ? AND rank = ? AND last_ts_ns > ?"
            " AND first_ts_ns <= ?", args).fetchone()[0]
        rise = max((value for value in (known, found, rolled) if value is not None), default=None)
        self._rises[ts_ns] = rise
        return rise

    def _point(self, row: tuple[Any, ...] | None) -> ServingPoint | None:
        if row is None:
            return None
        sample = Sample.from_row((self._run_id, *row[1:]))
        ledger = copy.copy(self._ledger)
        ledger.saw_step_rise(self._rise_until(sample.ts_ns - 1))
        return serving_point(sample, ledger.on_sample(sample))

    def _search(self, condition: str, params: tuple[Any, ...], latest: bool,
                step_from: int | None = None) -> ServingPoint | None:
        """The earliest (or latest) point meeting ``condition`` ({p} stands for the rolled-up prefix)."""
        if self._first is None or self._key is None:
            return None
        order = "DESC" if latest else "ASC"
        found = []
        for table, columns, ts, prefix, step in (
            ("sample_rows", RAW_SELECT, "ts_ns", "", "step"),
            ("sample_seconds", ROLLED_SELECT, "last_ts_ns", "last_", "last_step"),
        ):
            where = (f"run_key = ? AND rank = ? AND {ts} >= ? AND {ts} <= ?"
                     f" AND ({prefix}phase IS NULL OR {prefix}phase {_SKIP_STARTUP})")
            args: list[Any] = [self._key, self._rank, self._first.ts_ns, self._until]  # type: ignore[type-arg]
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

    def first(self) -> ServingPoint | None:
        return self._first

    def last(self) -> ServingPoint | None:
        return self._search("", (), latest=True)

    def last_at_most(self, term: str, limit: int) -> ServingPoint | None:
        return self._search(f"{_TERMS[term]} <= ?", (limit,), latest=True)

    def first_reaching(self, term: str, from_step: int, threshold: float) -> ServingPoint | None:
        return self._search(f"{_TERMS[term]} >= ?", (threshold,), latest=False, step_from=from_step)

    def first_from_step(self, step: int) -> ServingPoint | None:
        return self._search("", (), latest=False, step_from=step)


LEDGER_EVENTS = (KV_ALLOCATED, WEIGHTS_LOADED, PHASE_END)
"""The events that change a rank's ledger terms."""


def _events(db: Database, run_id: str, kinds: tuple[str, ...], rank: int | None = None,
            until_ns: int | None = None) -> list[Event]:
    sql = (f"SELECT run_id, rank, step, ts_ns, kind, data FROM events WHERE run_id = ?"
           f" AND kind IN ({', '.join('?' * len(kinds))})")
    params: list[Any] = [run_id, *kinds]
    if rank is not None:
        sql += " AND rank = ?"
        params.append(rank)
    if until_ns is not None:
        sql += " AND ts_ns <= ?"
        params.append(until_ns)
    return [Event(*row[:5], json.loads(row[5] or "{}")) for row in db.execute(sql + " ORDER BY ts_ns, rowid", params)]


def stored_readings(db: Database, run_id: str,
                    summaries: dict[int, RankSummary]) -> dict[int, RankReadings]:
    """Each rank's raw readings (what a crash or an unsized rank is explained with), from its summary and
    one indexed read of its last :data:`~memwatch.report.readings.WINDOW_STEPS` samples."""
    key = run_key(db, run_id)
    readings: dict[int, RankReadings] = {}
    for rank, summary in summaries.items():
        result = readings[rank] = RankReadings(rank, samples=summary.samples, max_peak_bytes=summary.max_peak_bytes,
                                               max_reserved_bytes=summary.max_reserved_bytes,
                                               max_driver_used_bytes=summary.max_driver_used_bytes)
        if key is None:
            continue
        rows = []
        for table, columns, order in (("sample_seconds", ROLLED_SELECT, "second DESC"),
                                      ("sample_rows", RAW_SELECT, "ts_ns DESC, rowid DESC")):
            newest_first = db.execute(f"SELECT {columns} FROM {table} WHERE run_key = ? AND rank = ?"
                                      f" ORDER BY {order} LIMIT ?", (key, rank, WINDOW_STEPS)).fetchall()
            rows += reversed(newest_first)
        # in time order, then as stored (a stable sort keeps the order of samples at the same time)
        last = sorted((Sample.from_row((run_id, *row)) for row in rows), key=lambda s: s.ts_ns)[-WINDOW_STEPS:]
        result.window.extend(last)
        result.last = last[-1] if last else None
        if result.last is not None and result.last.driver_used_bytes is not None \
                and result.last.driver_free_bytes is not None:
            result.total_bytes = result.last.driver_used_bytes + result.last.driver_free_bytes
        result.first_serving = summary.first_running
    return readings


def first_ooms(db: Database, run_id: str) -> dict[int, Event]:
    """Each rank's first out-of-memory event."""
    ooms: dict[int, Event] = {}
    for event in _events(db, run_id, (OOM,)):
        ooms.setdefault(event.rank, event)
    return ooms
