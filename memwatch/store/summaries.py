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
from ..detectors.summary import RankSummary
from ..flags import Flag

if TYPE_CHECKING:
    from memwatch.store.db import Database

UPSERT_SUMMARY = (
    "INSERT INTO rank_summaries (run_id, rank, complete, detector_config, samples, last_step, last_ts_ns, summary)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, rank) DO UPDATE SET complete = excluded.complete,"
    " detector_config = excluded.detector_config, samples = excluded.samples, last_step = excluded.last_step,"
    " last_ts_ns = excluded.last_ts_ns, summary = excluded.summary"
)


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
