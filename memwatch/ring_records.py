"""A ring's contents as typed records, in the order the engine wrote them.

The collector turns every drain into :class:`~memwatch.records.Sample` and :class:`~memwatch.records.Event`
for its observers (the live detectors, the exporters); ``attach`` does the same for its live view, and
the scorecard and the tests read whole ring files.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from operator import itemgetter
from pathlib import Path
from types import SimpleNamespace
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
    """Samples and events of one drain as typed records, in the order the engine wrote them.

    The sidecar calls this for every record it stores (64,000 a second at full load), so a sample is
    built straight from its field values (``-1`` in the ring: not measured), without per-field calls.
    """
    new, kinds = tuple.__new__, STEP_KINDS
    samples = [
        (s[0], new(Sample, (
            run_id, rank, s[5], s[6], names.get(s[3]),
            *[None if v < 0 else v for v in _MEASURED(s)],
            kinds[s[4]] if s[4] < 3 else None, bool(s[2] & 1), None,
            *[None if v < 0 else v for v in s[16:21]], *_NO_SIGNALS[len(s) - 16:],  # version 1: no signals
        )))
        for s in drained.samples
    ]
    if not drained.events:
        return [record for _, record in samples]
    merged: list[tuple[int, Sample | Event]] = [*samples]
    merged += [(seq, Event(run_id, rank, step, ts_ns, kind, data)) for seq, step, ts_ns, kind, data in drained.events]
    merged.sort(key=lambda pair: pair[0])
    return [record for _, record in merged]


def typed_sample(run_id: str, rank: int, row: tuple[Any, ...], names: dict[int, str | None]) -> Sample:
    """One ring sample tuple as a typed :class:`Sample`, as :func:`typed_records` builds it."""
    return typed_records(run_id, rank, SimpleNamespace(samples=[row], events=()), names)[0]  # type: ignore[return-value]


class RingDrain:
    """One drain of one ring as the collector hands it to observers that read the ring's own tuples
    (``takes_drain = True``; the live detectors): typed records are built only if someone asks, and observers
    that read events alone (``events_only = True``) get just those."""

    __slots__ = ("_records", "drained", "names", "rank", "run_id")

    def __init__(self, run_id: str, rank: int, drained: Any, names: dict[int, str | None]) -> None:
        self.run_id, self.rank, self.drained, self.names = run_id, rank, drained, names
        self._records: list[Sample | Event] | None = None

    @property
    def records(self) -> list[Sample | Event]:
        """Every record typed, in ring order (built once, on the first ask)."""
        if self._records is None:
            self._records = typed_records(self.run_id, self.rank, self.drained, self.names)
        return self._records

    @property
    def events(self) -> list[Event]:
        """The drain's events typed, in order (for observers that read no sample)."""
        return [Event(self.run_id, self.rank, step, ts_ns, kind, data)
                for _seq, step, ts_ns, kind, data in self.drained.events]

    def in_order(self, skip: frozenset[str] = frozenset()) -> Iterator[range | Event]:
        """In ring order: runs of consecutive samples (as ranges of indexes into ``drained.samples``), and
        each event typed between them, but those whose kind is in ``skip`` (a reader that ignores them, e.g.
        requests, need not see them, and they do not cut a run of samples)."""
        samples = self.drained.samples
        start = 0
        seqs: list[int] | None = None
        for seq, step, ts_ns, kind, data in self.drained.events:
            if kind in skip:
                continue
            if seqs is None:
                seqs = [row[0] for row in samples]
            end = bisect_left(seqs, seq, start)
            if end > start:
                yield range(start, end)
            start = end
            yield Event(self.run_id, self.rank, step, ts_ns, kind, data)
        if start < len(samples):
            yield range(start, len(samples))


_MEASURED = itemgetter(7, 8, 9, 10, 11, 13, 14, 15, 12)
"""A ring sample's measured fields in :class:`Sample` order: allocator and driver bytes, KV blocks, batch."""
_NO_SIGNALS = (None,) * 5
"""The allocator signals of a version 1 ring's sample, which has none."""
