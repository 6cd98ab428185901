"""Samples a run lost, and where: so no report reads as complete when it is not.

The engine never waits for the sidecar: when the sidecar falls behind (stopped, starved, a full
disk) by more than a ring's capacity, the oldest records are overwritten. The collector counts them
per rank (``ranks.lost_records``) and stores a ``samples_lost`` event at each gap, whose data gives
``count``, ``from_ts_ns`` (the last record read before the gap) and ``to_ts_ns`` (the first after).

The engine reports losses of its own the same way: an engine that started before its runtime directory
existed keeps a bounded number of samples in memory and writes one ``samples_lost`` event (with ``why``)
for the rest. The collector adds that ``count`` to ``ranks.lost_records`` too (:func:`reported_lost`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memwatch.store.db import Database

LOST_EVENT = "samples_lost"
MAX_REPORTED = 1 << 40
"""An engine's own count above this is not believed (a ring is hostile input): it counts as one gap of 0."""


def reported_lost(events: Iterable[tuple[Any, ...]]) -> int:
    """Samples the engine itself says it lost: the ``count`` of its ``samples_lost`` events (``(seq, step, ts_ns,
    kind, data)`` tuples as the ring reader drains them), each bounded; anything malformed counts 0."""
    total = 0
    for event in events:
        if event[3] != LOST_EVENT or not isinstance(event[4], dict):
            continue
        count = event[4].get("count")
        if isinstance(count, int) and not isinstance(count, bool) and 0 < count <= MAX_REPORTED:
            total += count
    return total


@dataclass(frozen=True)
class Gap:
    """Records of one rank overwritten in the ring before the sidecar read them."""

    rank: int
    count: int
    from_ts_ns: int | None
    to_ts_ns: int | None


@dataclass(frozen=True)
class Losses:
    """A run's lost records: the total per rank and each gap."""

    per_rank: dict[int, int]
    gaps: tuple[Gap, ...]

    @property
    def total(self) -> int:
        return sum(self.per_rank.values())

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "per_rank": {str(k): v for k, v in self.per_rank.items()},
                "gaps": [asdict(gap) for gap in self.gaps]}


def run_losses(db: Database, run_id: str) -> Losses:
    """What ``run_id`` lost, from ``ranks.lost_records`` and the ``samples_lost`` events."""
    per_rank = {rank: lost for rank, lost in db.execute(
        "SELECT rank, lost_records FROM ranks WHERE run_id = ? AND lost_records > 0 ORDER BY rank", (run_id,))}
    gaps = []
    for rank, data in db.execute(
        "SELECT rank, data FROM events WHERE run_id = ? AND kind = ? ORDER BY ts_ns, rowid", (run_id, LOST_EVENT)
    ):
        try:
            fields = json.loads(data or "{}")
            gaps.append(Gap(rank, int(fields.get("count") or 0), fields.get("from_ts_ns"), fields.get("to_ts_ns")))
        except (ValueError, TypeError, AttributeError):
            continue
    return Losses(per_rank, tuple(gaps))


def lost_per_run(db: Database) -> dict[str, int]:
    """Lost records per run id (runs that lost none are absent)."""
    return dict(db.execute("SELECT run_id, sum(lost_records) FROM ranks GROUP BY run_id HAVING sum(lost_records) > 0"))


def render_losses(losses: Losses, start_ns: int | None) -> list[str]:
    """Lines for a text report; none when nothing was lost."""
    if not losses.total:
        return []
    lines = [f"incomplete: {losses.total:,} samples were lost (the ring overwrote them before the sidecar read "
             "them, or the engine could not keep them); figures between the gaps below are missing"]
    for gap in losses.gaps:
        lines.append(f"  rank {gap.rank}: {gap.count:,} lost {span(gap, start_ns)}")
    return lines


def span(gap: Gap, start_ns: int | None) -> str:
    """``between T+12.300s and T+42.512s`` relative to the run's start."""
    def at(ts: int | None) -> str:
        return "?" if ts is None or start_ns is None else f"T+{(ts - start_ns) / 1e9:.3f}s"

    return f"between {at(gap.from_ts_ns)} and {at(gap.to_ts_ns)}"
