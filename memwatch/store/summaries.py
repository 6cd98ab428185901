"""The per-rank summaries the sidecar stores as it goes, and the stored flags: what check and explain read.

A summary is stored ``complete`` only when the sidecar's detectors saw the run from its first record;
one restarted mid-run stores partial summaries, which readers ignore (they replay instead). A
summary also names the detector thresholds it was computed with, so asking for other thresholds
replays too.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from ..detectors import DetectorConfig
from ..detectors.summary import SEARCHED_TERMS, RankSummary
from ..flags import Flag

if TYPE_CHECKING:
    from memwatch.store.db import Database

UPSERT_SUMMARY = (
    "INSERT INTO rank_summaries (run_id, rank, complete, detector_config, samples, last_step, last_ts_ns, summary)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, rank) DO UPDATE SET complete = excluded.complete,"
    " detector_config = excluded.detector_config, samples = excluded.samples, last_step = excluded.last_step,"
    " last_ts_ns = excluded.last_ts_ns, summary = excluded.summary"
)


_MERGED = ", ".join(
    f"{column} = coalesce({column[:3]}({column}, excluded.{column}), {column}, excluded.{column})"
    for column in (*(f"{bound}_{term}" for term in SEARCHED_TERMS for bound in ("min", "max")), "max_step_rise_bytes")
)
UPSERT_MINUTE = (
    "INSERT INTO serving_minutes (run_id, rank, minute, min_non_torch_bytes, max_non_torch_bytes,"
    " min_cache_slack_bytes, max_cache_slack_bytes, min_allocated_bytes, max_allocated_bytes, max_step_rise_bytes)"
    f" VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, rank, minute) DO UPDATE SET {_MERGED}"
)


def minute_rows(run_id: str, summary: RankSummary) -> list[tuple[Any, ...]]:
    """The minutes the summary touched since the last call, as ``serving_minutes`` rows; forgets them."""
    rows = []
    for key, minute in summary.minutes.items():
        bounds = [value for pair in zip(minute.low, minute.high, strict=True) for value in pair]
        rows.append((run_id, summary.rank, key, *bounds, minute.max_step_rise_bytes))
    summary.minutes.clear()
    return rows


def config_key(config: DetectorConfig | None) -> str:
    """The thresholds as stable JSON text (what a stored summary is compared on)."""
    return json.dumps(dataclasses.asdict(config or DetectorConfig()), sort_keys=True)


def summary_params(run_id: str, summary: RankSummary, complete: bool, config: str) -> tuple[Any, ...]:
    return (run_id, summary.rank, int(complete), config, summary.samples, summary.last_step, summary.last_ts_ns,
            json.dumps(summary.to_json()))


def load_summaries(
    db: Database, run_id: str, config: DetectorConfig | None = None
) -> dict[int, RankSummary] | None:
    """The run's stored summaries by rank, or ``None`` unless every one is complete and used ``config``."""
    if "rank_summaries" not in db.table_names():
        return None
    rows = db.execute("SELECT rank, complete, detector_config, summary FROM rank_summaries WHERE run_id = ?",
                      (run_id,)).fetchall()
    wanted = config_key(config)
    if not rows or any(not complete or stored != wanted for _, complete, stored, _ in rows):
        return None
    return {rank: RankSummary.from_json(json.loads(text)) for rank, _, _, text in rows}


def stored_flags(db: Database, run_id: str) -> list[Flag]:
    """The flags stored for a run, in time order."""
    rows = db.execute("SELECT run_id, rank, step, ts_ns, kind, severity, message, data FROM flags WHERE run_id = ?"
                      " ORDER BY ts_ns, rank, rowid", (run_id,))
    return [Flag(*row[:7], json.loads(row[7] or "{}")) for row in rows]
