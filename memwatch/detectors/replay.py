"""Replay a stored timeline through the ledger and detectors: what ``memwatch check`` and ``explain`` read.

The result holds every flag and, per rank, the final ledger terms and the tightest moments (the
smallest headroom and the smallest OOM margin, with their steps), which is where a post-mortem
starts looking.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.detector_set import DetectorSet
from memwatch.detectors.summary import RankSummary, Tightest
from memwatch.flags import Flag
from memwatch.records import Event, Sample

__all__ = ["RankSummary", "ReplayResult", "Tightest", "interleave", "replay"]


@dataclass
class ReplayResult:
    """Every flag in order, and one summary per rank."""

    flags: list[Flag] = field(default_factory=list)
    ranks: dict[int, RankSummary] = field(default_factory=dict)


def interleave(samples: Iterable[Sample], events: Iterable[Event]) -> Iterator[Sample | Event]:
    """Merge time-ordered samples and events into one stream; at equal times the event comes first.

    An event at a step is what the step's sample already reflects (the KV cache it announces is in
    the sample's allocation), so it is taken in before the sample.
    """
    keyed_events = ((event.ts_ns, 0, position, event) for position, event in enumerate(events))
    keyed_samples = ((sample.ts_ns, 1, position, sample) for position, sample in enumerate(samples))
    for _ts, _order, _position, record in heapq.merge(keyed_events, keyed_samples):
        yield record


def replay(records: Iterable[Sample | Event], config: DetectorConfig | None = None) -> ReplayResult:
    """Feed one run's records, in order, through a fresh :class:`DetectorSet`."""
    detectors = DetectorSet(config)
    result = ReplayResult()
    summaries = result.ranks
    for record in records:
        if isinstance(record, Event):
            result.flags.extend(detectors.on_event(record))
            continue
        result.flags.extend(detectors.on_sample(record))
        summary = summaries.get(record.rank)
        if summary is None:
            summary = summaries[record.rank] = RankSummary(record.rank)
        terms = detectors.last_terms(record.rank)
        assert terms is not None  # on_sample always leaves the sample's terms
        summary.observe(record, terms)
    for rank, summary in summaries.items():
        summary.sizing = detectors.ledger(rank).sizing
    return result
