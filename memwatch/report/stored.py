"""A stored run as check and explain read it: summaries and flags, and indexed searches of its samples.

When the sidecar stored complete summaries with the same thresholds, reading a run costs a few
rows whatever its length. Otherwise the run is replayed through the detectors as a stream
(memory stays bounded; time grows with the run). ``explain`` then looks at an out-of-memory rank
through :class:`~memwatch.report.stored_points.StoredPoints`, a handful of indexed queries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memwatch.detectors import DetectorConfig, interleave, replay
from memwatch.detectors.summary import RankSummary
from memwatch.flags import OOM, Flag
from memwatch.records import Event, Sample
from memwatch.report.readings import WINDOW_STEPS, RankReadings
from memwatch.report.stored_points import LEDGER_EVENTS
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
    # A run on a CPU device (memwatch_engine/probes/cpu.py) says why its ranks read nothing, instead of unknowns.
    [cpu] = db.execute("SELECT max(probe_unavailable) FROM ranks WHERE run_id = ? AND gpu_name = 'CPU'",
                       (run_id,)).fetchone()
    for rank, summary in summaries.items():
        result = readings[rank] = RankReadings(rank, samples=summary.samples, max_peak_bytes=summary.max_peak_bytes,
                                               max_reserved_bytes=summary.max_reserved_bytes,
                                               max_driver_used_bytes=summary.max_driver_used_bytes,
                                               device_note=cpu)
        if key is None:
            continue
        rows = []
        for table, columns, order in (("sample_seconds", ROLLED_SELECT, "second DESC"),
                                      ("sample_rows", RAW_SELECT, "ts_ns DESC, seq DESC")):
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


def ledger_events(db: Database, run_id: str, rank: int, until_ns: int) -> list[Event]:
    """The rank's events that change its ledger, up to ``until_ns``."""
    return _events(db, run_id, LEDGER_EVENTS, rank, until_ns)


def first_ooms(db: Database, run_id: str) -> dict[int, Event]:
    """Each rank's first out-of-memory event."""
    ooms: dict[int, Event] = {}
    for event in _events(db, run_id, (OOM,)):
        ooms.setdefault(event.rank, event)
    return ooms
