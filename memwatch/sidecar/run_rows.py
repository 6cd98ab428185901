"""The rows of ``runs`` and ``ranks`` a ring's life writes: registered when it opens, counted as it drains, ended."""

from __future__ import annotations

import json
from typing import Any

from memwatch_engine.ring_reader import RingHeader

from ..identity import COLUMNS as PLACE_COLUMNS
from ..identity import place_from_meta

Statement = tuple[str, tuple[Any, ...]]

RUN_STATUS = """
UPDATE runs SET
  ended_ns = (SELECT max(ended_ns) FROM ranks WHERE run_id = ?),
  status = CASE
    WHEN EXISTS (SELECT 1 FROM ranks WHERE run_id = ? AND status = 'running') THEN 'running'
    WHEN EXISTS (SELECT 1 FROM ranks WHERE run_id = ? AND status = 'oom') THEN 'oom'
    WHEN EXISTS (SELECT 1 FROM ranks WHERE run_id = ? AND status = 'crashed') THEN 'crashed'
    WHEN EXISTS (SELECT 1 FROM ranks WHERE run_id = ? AND status NOT IN ('ok', 'detached')) THEN 'error'
    WHEN EXISTS (SELECT 1 FROM ranks WHERE run_id = ? AND status = 'detached') THEN 'detached'
    ELSE 'ok' END
WHERE run_id = ? AND (SELECT count(*) FROM ranks WHERE run_id = ?) > 0
"""


def register(header: RingHeader) -> list[Statement]:
    """Statements that create the run (first rank seen) and the rank rows for a new ring."""
    meta = header.meta
    place = place_from_meta(meta)
    return [
        (
            "INSERT INTO runs (run_id, pid, hostname, engine, model, rank_count, started_ns, status,"
            f" gpu_name, gpu_total_bytes, config, source, {', '.join(PLACE_COLUMNS)})"
            " VALUES (?, ?, ?, ?, ?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(run_id) DO UPDATE SET started_ns = min(started_ns, excluded.started_ns),"
            " status = 'running', pid = CASE WHEN ? = 0 THEN excluded.pid ELSE pid END",
            (
                header.run_id, meta.get("pid", header.writer_pid), meta.get("hostname"), meta.get("engine"),
                meta.get("model"), header.world_size, header.created_ns, meta.get("gpu_name"),
                meta.get("gpu_total_bytes"), json.dumps(meta.get("config") or {}),
                meta.get("source", "engine"), *(place.get(column) for column in PLACE_COLUMNS), header.rank,
            ),
        ),
        (
            "INSERT OR REPLACE INTO ranks (run_id, rank, pid, device_index, gpu_name, gpu_total_bytes,"
            " started_ns, status, probe_unavailable) VALUES (?, ?, ?, ?, ?, ?, ?, 'running', ?)",
            (
                header.run_id, header.rank, header.writer_pid, meta.get("device_index"), meta.get("gpu_name"),
                meta.get("gpu_total_bytes"), header.created_ns, meta.get("probe_unavailable"),
            ),
        ),
    ]


def rank_progress(header: RingHeader, count: int, lost: int) -> Statement:
    """Adds a drain's ``count`` records to the rank and sets its lost records so far."""
    return (
        "UPDATE ranks SET records = records + ?, lost_records = ? WHERE run_id = ? AND rank = ?",
        (count, lost, header.run_id, header.rank),
    )


def rank_end(header: RingHeader, status: str, ended_ns: int | None, lost: int) -> list[Statement]:
    """Ends the rank with ``status``, then settles the run's status and end from all its ranks."""
    run_id = header.run_id
    return [
        ("UPDATE ranks SET status = ?, ended_ns = ?, lost_records = ? WHERE run_id = ? AND rank = ?",
         (status, ended_ns, lost, run_id, header.rank)),
        (RUN_STATUS, (run_id,) * 8),
    ]
