"""Joining a memory snapshot to a stored run: what it shows becomes events of one rank.

Events written (their ``data`` is JSON):

* ``snapshot_imported``: the file, its SHA-256, segment and trace-entry counts, reserved and allocated bytes,
  and ``set_aside``: entries left out for a number out of range.
* ``snapshot_allocation``: one per largest live allocation (:data:`~.reader.TOP_ALLOCATIONS`), with its
  requested size, segment and top :data:`~.reader.TOP_FRAMES` frames.
* ``snapshot_segments``: segment growth in the trace (``segment_alloc``/``segment_free`` counts and
  bytes) and the last segments the allocator asked ``cudaMalloc`` for.
* ``snapshot_oom``: one per ``oom`` entry of the trace (its last :data:`~.reader.MAX_OOMS`): requested
  bytes, what CUDA still had free, its frames.

Trace entries carry their own wall-clock time (``time_us``), so they land at their moment in the
timeline; the rest is placed at the snapshot's moment (its ``oom`` entry, else the rank's ``oom``
event, else its last sample), at the step of the rank's last sample by then.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memwatch.errors import UsageError
from memwatch.records import Event
from memwatch.snapshot.reader import Frame, MemorySnapshot, TraceEntry
from memwatch.snapshot.untrusted import read_snapshot
from memwatch.store.queries import Run, events, get_run
from memwatch.store.writer import INSERT_EVENT

if TYPE_CHECKING:
    from memwatch.store.db import Database

SNAPSHOT_KINDS = ("snapshot_imported", "snapshot_allocation", "snapshot_segments", "snapshot_oom")


@dataclass(frozen=True)
class ImportResult:
    run_id: str
    rank: int
    events: tuple[Event, ...]
    already_imported: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "rank": self.rank, "already_imported": self.already_imported,
                "events": [{"kind": e.kind, "step": e.step, "ts_ns": e.ts_ns, "data": e.data} for e in self.events]}


def _frames(frames: tuple[Frame, ...]) -> list[dict[str, Any]]:
    return [f.to_dict() for f in frames]


def _step_at(db: Database, run_id: str, rank: int, ts_ns: int) -> int:
    row = db.execute(
        "SELECT step FROM samples WHERE run_id = ? AND rank = ? AND ts_ns <= ? ORDER BY ts_ns DESC LIMIT 1",
        (run_id, rank, ts_ns),
    ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _moment(db: Database, run_id: str, rank: int, snapshot: MemorySnapshot,
            oom_event: Event | None) -> int:
    if snapshot.oom_time_us:
        return snapshot.oom_time_us * 1000
    if oom_event is not None:
        return oom_event.ts_ns
    row = db.execute("SELECT max(ts_ns) FROM samples WHERE run_id = ? AND rank = ?", (run_id, rank)).fetchone()
    if row[0] is None:
        row = db.execute("SELECT coalesce(ended_ns, started_ns, 0) FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return int(row[0] or 0) if row else 0


def snapshot_events(db: Database, run_id: str, rank: int, snapshot: MemorySnapshot, *,
                    path: str, sha256: str, oom_event: Event | None = None) -> list[Event]:
    """The events a snapshot adds to ``rank`` of ``run_id`` (reads only the run's samples and events).

    ``oom_event`` is the rank's ``oom`` event when the caller holds it (the sidecar, before it is stored).
    """
    if oom_event is None:
        oom_event = next((e for e in events(db, run_id, rank=rank) if e.kind == "oom"), None)
    moment = _moment(db, run_id, rank, snapshot, oom_event)
    step = oom_event.step if oom_event is not None else _step_at(db, run_id, rank, moment)

    def event(kind: str, data: dict[str, Any], ts_ns: int = moment) -> Event:
        at_step = step if ts_ns == moment else _step_at(db, run_id, rank, ts_ns)
        return Event(run_id, rank, at_step, ts_ns, kind, data)

    out = [event("snapshot_imported", {
        "path": path, "sha256": sha256, "devices": list(snapshot.devices), "segments": snapshot.segments,
        "reserved_bytes": snapshot.reserved_bytes, "allocated_bytes": snapshot.allocated_bytes,
        "trace_entries": snapshot.trace_entries, "trace_actions": dict(snapshot.trace_actions),
        "set_aside": snapshot.set_aside,
    })]
    for place, block in enumerate(snapshot.largest, start=1):
        out.append(event("snapshot_allocation", {
            "place": place, "size_bytes": block.size, "requested_bytes": block.requested_size,
            "address": block.address, "segment_address": block.segment_address, "device": block.device,
            "frames": _frames(block.frames),
        }))
    out.append(event("snapshot_segments", {
        "segments": snapshot.segments, "reserved_bytes": snapshot.reserved_bytes,
        "live_allocations": snapshot.live_allocations, "segment_allocs": snapshot.segment_allocs,
        "segment_alloc_bytes": snapshot.segment_alloc_bytes, "segment_frees": snapshot.segment_frees,
        "segment_free_bytes": snapshot.segment_free_bytes,
        "last_segment_allocs": [_entry(t) for t in snapshot.last_segment_allocs],
    }))
    for entry in snapshot.ooms:
        ts = entry.time_us * 1000 if entry.time_us else moment
        out.append(event("snapshot_oom", {
            "requested_bytes": entry.size, "device_free_bytes": entry.device_free, "device": entry.device,
            "stream": entry.stream, "frames": _frames(entry.frames),
        }, ts))
    return out


def _entry(entry: TraceEntry) -> dict[str, Any]:
    return {"address": entry.addr, "size_bytes": entry.size, "time_us": entry.time_us, "device": entry.device,
            "frames": _frames(entry.frames)}


def _rank_for(db: Database, run: Run, path: Path, rank: int | None) -> int:
    ranks = [int(r[0]) for r in db.execute("SELECT rank FROM ranks WHERE run_id = ? ORDER BY rank", (run.run_id,))]
    if rank is not None:
        if ranks and rank not in ranks:
            raise UsageError(f"run {run.run_id} has no rank {rank} (it has {', '.join(map(str, ranks))}); "
                             "pass one of those to --rank")
        return rank
    for event in events(db, run.run_id):
        named = event.data.get("snapshot_path") if event.kind == "oom" else None
        if named and Path(str(named)).name == path.name:
            return event.rank
    return ranks[0] if ranks else 0


def import_snapshot(db: Database, ref: str, path: str | Path, *, rank: int | None = None) -> ImportResult:
    """Read ``path`` and store its events on ``ref``'s rank (the one whose OOM wrote it, else ``rank`` or the first).

    Importing the same file (by content) into the same run twice stores nothing the second time.
    """
    path = Path(path)
    run = get_run(db, ref)
    snapshot, sha256 = read_snapshot(path)
    chosen = _rank_for(db, run, path, rank)
    for event in events(db, run.run_id):
        if event.kind == "snapshot_imported" and event.data.get("sha256") == sha256:
            return ImportResult(run.run_id, event.rank, (), already_imported=True)
    new = snapshot_events(db, run.run_id, chosen, snapshot, path=str(path.resolve()), sha256=sha256)
    with db.conn:
        db.conn.executemany(INSERT_EVENT, [e.to_row() for e in new])
    return ImportResult(run.run_id, chosen, tuple(new))
