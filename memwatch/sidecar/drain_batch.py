"""What one drain of a ring stores: the rows, statements and flags of one :class:`~memwatch.store.writer.Batch`.

Events go first (a ``phase_start`` teaches the reader a custom phase code later samples use); a ``config`` event
also patches the run's config, ``run_end`` and ``oom`` set how the rank will end; records the ring could not
decode are set aside whole; samples the writer overwrote before they were read become one ``samples_lost``
event; the samples go in as the ring holds them; and every observer (detectors, summaries, exporters) adds
its flags and statements to the same transaction.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..ring_records import RingDrain
from ..store.writer import Batch
from .ring_state import RingState

EARLIEST_BEFORE_RING_NS = 24 * 3600 * 10**9
"""How long before its ring a record may be stamped and still start the run: records an engine kept while it
waited for the runtime directory are written when the ring is made, minutes later; a day earlier is a clock
that jumped, and the run keeps its ring's time."""


def drain_batch(state: RingState, drained: Any, run_key: Callable[[str], int | None],
                observers: list[Any]) -> Batch:
    """The batch that stores ``drained`` (one :meth:`RingReader.drain` of ``state``'s ring); ``run_key`` looks up
    the run's key once its row has committed."""
    header = state.header
    run_id, rank = header.run_id, header.rank
    batch = Batch()
    events = drained.events
    # Events first: a phase_start teaches the reader a custom phase code used by later samples.
    for _seq, step, ts_ns, kind, data in events:
        batch.events.append((run_id, rank, step, ts_ns, kind, json.dumps(data)))
        if kind == "config":
            batch.statements.append(
                ("UPDATE runs SET config = json_patch(config, ?) WHERE run_id = ?", (json.dumps(data), run_id))
            )
        elif kind == "run_end":
            state.end_status = str(data.get("status", "ok"))
        elif kind == "oom":
            state.saw_oom = True
    for seq, ts_ns, why, raw in drained.bad:
        batch.set_aside.append((run_id, rank, seq, ts_ns or None, why, raw))
    if drained.lost:
        first = (drained.samples[0][6] if drained.samples else events[0][2] if events else state.last_ts_ns)
        batch.events.append((run_id, rank, drained.samples[0][5] if drained.samples else None, first,
                             "samples_lost", json.dumps({
                                 "count": drained.lost, "from_ts_ns": state.last_ts_ns or None, "to_ts_ns": first,
                             })))
    _start_at_earliest(state, batch, [sample[6] for sample in drained.samples[:1]] + [e[2] for e in events[:1]])
    names = state.reader.phase_names
    if drained.samples:
        if state.run_key is None:
            state.learn_run_key(run_key(run_id))
        batch.ring_samples.append((state.sample_insert(drained.slots), drained.samples))
    last_sample_ts = drained.samples[-1][6] if drained.samples else 0
    last_event_ts = events[-1][2] if events else 0
    state.last_ts_ns = max(state.last_ts_ns, last_sample_ts, last_event_ts)
    if observers:
        drain = RingDrain(run_id, rank, drained, names)  # typed records only for observers that want them
        for observer in observers:
            if getattr(observer, "takes_drain", False):
                given: Any = drain
            elif getattr(observer, "events_only", False):
                given = drain.events
            else:
                given = drain.records
            batch.flags.extend(observer(header, given))
            statements = getattr(observer, "statements", None)  # e.g. per-rank summaries kept live
            if statements is not None:
                batch.statements.extend(statements(header))
    return batch


def _start_at_earliest(state: RingState, batch: Batch, first_ts_ns: list[int]) -> None:
    """A run starts at its first record: one stamped before its ring (kept while the engine waited for the runtime
    directory, or a simulator's clock started a moment earlier) moves the run's and the rank's start back to it."""
    header = state.header
    stamped = [ts for ts in first_ts_ns if ts >= header.created_ns - EARLIEST_BEFORE_RING_NS]
    earliest = min(stamped, default=header.created_ns)
    if earliest >= (state.started_ns or header.created_ns):
        return
    state.started_ns = earliest
    batch.statements.append(("UPDATE runs SET started_ns = min(started_ns, ?) WHERE run_id = ?",
                             (earliest, header.run_id)))
    batch.statements.append(("UPDATE ranks SET started_ns = min(started_ns, ?) WHERE run_id = ? AND rank = ?",
                             (earliest, header.run_id, header.rank)))
