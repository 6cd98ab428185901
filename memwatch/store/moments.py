"""Points in a run's time that people name: ``+90s``, ``-5m``, an ISO time, the OOM, a flag, a step.

Used by ``timeline --since/--until/--around`` and by anything else that shows a window of a run.
Every lookup goes through an index: the OOM and flags are few, and a step is found by bisecting
time (steps only grow within a rank), so naming a moment costs the same on any run length.
"""

from __future__ import annotations

import re
from datetime import datetime

from ..errors import NotFoundError, UsageError
from ..flags import FLAG_KINDS
from .db import Database
from .queries import Run
from .window import run_key, time_span

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SCALE = {"ms": 1e6, "s": 1e9, None: 1e9, "m": 60e9, "h": 3600e9}


def parse_duration_ns(text: str) -> int:
    """``60s``, ``5m``, ``1.5h``, ``250ms`` or a bare number of seconds, in nanoseconds."""
    match = _DURATION.match(text)
    if not match:
        raise UsageError(f"cannot read duration {text!r}; write e.g. 60s, 5m, 1h or 250ms")
    return int(min(float(match.group(1)) * _SCALE[match.group(2)], 2.0**62))  # longer than any run: all of it


def resolve_time(db: Database, run: Run, text: str) -> int:
    """A time in ns: ``+DUR`` after the run's first sample, ``-DUR`` before its last, or an ISO date-time."""
    text = text.strip()
    if text[:1] in "+-":
        first, last = time_span(db, run.run_id)
        if first is None or last is None:
            raise NotFoundError(f"run {run.run_id} has no samples to count {text} from")
        offset = parse_duration_ns(text[1:])
        return first + offset if text[0] == "+" else last - offset
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"cannot read time {text!r}; write +90s (after the start), -5m (before the end) or an "
                         "ISO time like 2026-01-31T03:12:00") from None
    return int(moment.timestamp() * 1e9)


def find_moment(db: Database, run: Run, spec: str, rank: int | None = None) -> int:
    """The time of ``oom``, a flag kind (its first flag), or ``step:N`` (the first sample at or after step N)."""
    spec = spec.strip()
    if spec.startswith("step:"):
        try:
            step = int(spec[5:])
        except ValueError:
            raise UsageError(f"cannot read {spec!r}; write step:N with N a step number") from None
        return _step_time(db, run, step, rank)
    rank_clause, params = ("", ()) if rank is None else (" AND rank = ?", (rank,))
    if spec == "oom":
        row = db.execute(f"SELECT min(ts_ns) FROM events WHERE run_id = ? AND kind = 'oom'{rank_clause}",
                         (run.run_id, *params)).fetchone()
        if row[0] is None:
            row = db.execute(f"SELECT min(ts_ns) FROM flags WHERE run_id = ? AND kind = 'oom'{rank_clause}",
                             (run.run_id, *params)).fetchone()
        if row[0] is None:
            raise NotFoundError(f"run {run.run_id} has no out-of-memory" + ("" if rank is None else f" on rank {rank}")
                                + "; `memwatch flags` lists what it has")
        return int(row[0])
    if spec not in FLAG_KINDS:
        raise UsageError(f"cannot find {spec!r} in a run; use oom, step:N or a flag kind: {', '.join(FLAG_KINDS)}")
    row = db.execute(f"SELECT min(ts_ns) FROM flags WHERE run_id = ? AND kind = ?{rank_clause}",
                     (run.run_id, spec, *params)).fetchone()
    if row[0] is None:
        raise NotFoundError(f"run {run.run_id} has no {spec} flag" + ("" if rank is None else f" on rank {rank}")
                            + "; `memwatch flags` lists what it has")
    return int(row[0])


def _step_time(db: Database, run: Run, step: int, rank: int | None) -> int:
    key = run_key(db, run.run_id)
    if rank is None:
        row = db.execute("SELECT min(rank) FROM ranks WHERE run_id = ?", (run.run_id,)).fetchone()
        rank = row[0] if row and row[0] is not None else 0
    candidates = []
    rolled = db.execute("SELECT min(first_ts_ns) FROM sample_seconds WHERE run_key = ? AND rank = ? AND last_step >= ?",
                        (key, rank, step)).fetchone()[0]
    if rolled is not None:
        candidates.append(rolled)
    first, last = time_span(db, run.run_id, rank)
    if first is not None and last is not None:
        def step_at(ts: int) -> int | None:
            row = db.execute("SELECT step, ts_ns FROM sample_rows WHERE run_key = ? AND rank = ? AND ts_ns >= ?"
                             " ORDER BY ts_ns LIMIT 1", (key, rank, ts)).fetchone()
            return None if row is None else row[0]

        lo, hi = first, last  # the first time whose next sample has reached the step
        if (step_at(hi) or -1) >= step:
            while lo < hi:
                mid = (lo + hi) // 2
                value = step_at(mid)
                if value is not None and value >= step:
                    hi = mid
                else:
                    lo = mid + 1
            ts = db.execute("SELECT ts_ns FROM sample_rows WHERE run_key = ? AND rank = ? AND ts_ns >= ?"
                            " ORDER BY ts_ns LIMIT 1", (key, rank, lo)).fetchone()
            if ts is not None:
                candidates.append(ts[0])
    if not candidates:
        raise NotFoundError(f"run {run.run_id} rank {rank} never reached step {step}")
    return min(candidates)
