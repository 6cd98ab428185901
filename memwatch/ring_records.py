"""A ring's contents as typed records, in the order the engine wrote them.

The collector turns every drain into :class:`~memwatch.records.Sample` and :class:`~memwatch.records.Event`
for its observers (the live detectors, the exporters); ``attach`` does the same for its live view, and
the scorecard and the tests read whole ring files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memwatch_engine.ring import STEP_KINDS
from memwatch_engine.ring_reader import RingReader

from .records import Event, Sample


def read_ring(path: Path) -> list[Sample | Event]:
    """Every record still in a ring file, typed and in order (for tests, the scorecard and ``attach``)."""
    reader = RingReader(path)
    try:
        drained = reader.drain(0)
        header = reader.header
        return typed_records(header.run_id, header.rank, drained, reader.phase_names)
    finally:
        reader.close()


def typed_records(run_id: str, rank: int, drained: Any, names: dict[int, str | None]) -> list[Sample | Event]:
    """Samples and events of one drain as typed records, in the order the engine wrote them."""
    merged: list[tuple[int, Sample | Event]] = []
    for s in drained.samples:
        merged.append((s[0], Sample(
            run_id, rank, s[5], s[6], names.get(s[3]),
            *(None if v < 0 else v for v in (s[7], s[8], s[9], s[10], s[11], s[13], s[14], s[15], s[12])),
            STEP_KINDS[s[4]] if s[4] < 3 else None, bool(s[2] & 1), None,
            *(None if v < 0 else v for v in s[16:21]),  # allocator signals: absent from version 1 rings
        )))
    for seq, step, ts_ns, kind, data in drained.events:
        merged.append((seq, Event(run_id, rank, step, ts_ns, kind, data)))
    merged.sort(key=lambda pair: pair[0])
    return [record for _, record in merged]
