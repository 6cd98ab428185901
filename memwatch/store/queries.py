"""Read-side queries every post-mortem command shares: resolving a run, listing runs, a timeline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import NotFoundError, UsageError
from ..records import EVENT_COLUMNS, Event, Sample
from .window import time_span, window_samples

if TYPE_CHECKING:
    from memwatch.store.db import Database


@dataclass(frozen=True)
class Run:
    """A row of ``runs`` with its config decoded."""

    run_id: str
    pid: int | None
    hostname: str | None
    engine: str | None
    model: str | None
    rank_count: int | None
    started_ns: int | None
    ended_ns: int | None
    status: str | None
    gpu_name: str | None
    gpu_total_bytes: int | None
    config: dict[str, Any]
    source: str | None

    @property
    def duration_ns(self) -> int | None:
        """From start to last record, never negative; ``None`` while either end is unknown.

        The start is when the first ring was created, the end the last record's time: a record taken
        just before its ring existed (a run that died at its first sample) must not read as ``-0.0s``.
        """
        if not self.started_ns or not self.ended_ns:
            return None
        return max(self.ended_ns - self.started_ns, 0)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "duration_ns": self.duration_ns}


MAX_RUN_REF = 256
"""Run ids are at most 16 characters in rings; a reference far longer names no run."""

_RUN_COLUMNS = (
    "run_id, pid, hostname, engine, model, rank_count, started_ns, ended_ns, status, gpu_name,"
    " gpu_total_bytes, config, source"
)


def _run(row: tuple[Any, ...]) -> Run:
    """A ``runs`` row as :class:`Run`; a value of the wrong type (stored before the sidecar checked ring
    metadata, or by hand) reads as unknown instead of failing every command that lists the run."""
    values = list(row)
    for at in _RUN_INTS:
        values[at] = _int_or_none(values[at])
    for at in _RUN_TEXTS:
        values[at] = _text_or_none(values[at])
    try:
        config = json.loads(values[11] or "{}")
    except (ValueError, TypeError, RecursionError):
        config = {}
    values[11] = config if isinstance(config, dict) else {}
    return Run(*values)


_RUN_INTS = (1, 5, 6, 7, 10)
"""pid, rank_count, started_ns, ended_ns, gpu_total_bytes."""
_RUN_TEXTS = (2, 3, 4, 8, 9, 12)
"""hostname, engine, model, status, gpu_name, source."""
_RANK_INTS = ("pid", "device_index", "gpu_total_bytes", "started_ns", "ended_ns", "records", "lost_records")


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text_or_none(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def list_runs(db: Database, limit: int | None = None) -> list[Run]:
    """Runs, newest first."""
    sql = f"SELECT {_RUN_COLUMNS} FROM runs ORDER BY started_ns DESC"
    params: tuple[Any, ...] = ()
    if limit is not None:
        sql += " LIMIT ?"
        params = (limit,)
    return [_run(row) for row in db.execute(sql, params).fetchall()]


def get_run(db: Database, ref: str) -> Run:
    """A run by id, unique id prefix, or ``latest``."""
    if ref == "latest":
        row = db.execute(f"SELECT {_RUN_COLUMNS} FROM runs ORDER BY started_ns DESC LIMIT 1").fetchone()
        if row is None:
            raise NotFoundError("the database has no runs yet; start an engine with memwatch or run `memwatch demo`")
        return _run(row)
    if not ref.strip():
        raise UsageError("the run reference is empty; give a run id, a unique prefix of one, or `latest`")
    if len(ref) > MAX_RUN_REF:
        raise NotFoundError(f"no run {ref[:40]!r}… in the database (run ids are short); `memwatch runs` lists them")
    # A prefix match by substr, not LIKE: '%' and '_' in a reference are plain characters.
    rows = db.execute(
        f"SELECT {_RUN_COLUMNS} FROM runs WHERE substr(run_id, 1, ?) = ? ORDER BY run_id = ? DESC LIMIT 3",
        (len(ref), ref, ref),
    ).fetchall()
    if not rows:
        raise NotFoundError(f"no run {ref!r} in the database; `memwatch runs` lists them")
    if rows[0][0] != ref and len(rows) > 1:
        raise NotFoundError(f"run prefix {ref!r} is ambiguous; give more of the id (`memwatch runs`)")
    return _run(rows[0])


def run_ranks(db: Database, run_id: str) -> list[dict[str, Any]]:
    """A run's ``ranks`` rows; integer columns holding anything else read as unknown (``None``)."""
    ranks = list(db.query("SELECT * FROM ranks WHERE run_id = ? ORDER BY rank", (run_id,)))
    for rank in ranks:
        for column in _RANK_INTS:
            if column in rank:
                rank[column] = _int_or_none(rank[column])
        if isinstance(rank.get("gpu_name"), (bytes, int, float)):
            rank["gpu_name"] = _text_or_none(rank["gpu_name"])
    return ranks


def samples(
    db: Database, run_id: str, *, rank: int | None = None, since_ns: int | None = None,
    until_ns: int | None = None,
) -> Iterator[Sample]:
    """Samples of a run in time order (per rank when ``rank`` is given); a rolled-up second is its last sample."""
    return window_samples(db, run_id, rank=rank, since_ns=since_ns, until_ns=until_ns)


def events(db: Database, run_id: str, *, rank: int | None = None) -> list[Event]:
    sql = f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE run_id = ?"
    params: list[Any] = [run_id]
    if rank is not None:
        sql += " AND rank = ?"
        params.append(rank)
    sql += " ORDER BY ts_ns, rowid"
    return [Event(*row[:5], json.loads(row[5] or "{}")) for row in db.execute(sql, params)]


def last_ts_ns(db: Database, run_id: str) -> int | None:
    return time_span(db, run_id)[1]
