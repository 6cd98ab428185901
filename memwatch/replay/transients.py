"""Allocations a recording shows beside the engine's forwards, and the long-lived tensors born among them.

A step whose forward allocates nothing (a decode batch a captured CUDA graph replays) can still show a
rise in its own peak: something allocated a temporary and freed it within the step. When
``allocated`` also grew in that step, a long-lived tensor was born while the temporary lived; if it
landed in the tail of the temporary's segment, the segment can never be released (the recorded
``inactive_split_bytes`` and ``segments`` grow while ``allocated`` barely moves): fragmentation.

The replay performs the same requests at the same steps on its own caching allocator, which decides
where each lands and what it pins. The order follows what the recording's allocator signals say
happened: when the step's inactive split memory grew, the long-lived tensor is allocated while the
temporary lives (it lands in the temporary's segment and pins it); when it did not, the tensor filled
a hole that was already there, so it is allocated before the temporary. The slack grows as it grew,
and an out-of-memory comes where the temporary no longer finds a segment. Past the end of the
recording a regular series continues: the same period, the temporary growing by its usual step, the
same long-lived size each time, as a leak keeps leaking. Tensors of one size kept alive at a regular
period without a temporary (a leak inside PyTorch) continue the same way when they were still being
kept as the recording ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

from memwatch.records import Sample

SERIES_MIN_EVENTS = 3
"""Recorded events, pinning a tensor each time at a regular period, before a series continues past the end."""
KEEP_ALIVE_MIN_EVENTS = 8
"""Recorded tensors of one size kept at a regular period (no temporary) before they continue past the end."""


@dataclass(frozen=True)
class Transient:
    step: int
    temporary_bytes: int
    """Allocated and freed within the step, beside the forward (0: none)."""
    kept_bytes: int
    """Allocated within the step and never freed (0: none)."""
    pinned: bool = True
    """The step's inactive split memory grew: the kept tensor landed beside the temporary and pinned its
    segment (else it filled a hole that was already there, so the replay allocates it first)."""


@dataclass(frozen=True)
class TransientSeries:
    recorded: tuple[Transient, ...]
    period: int
    """Steps between events past the recording (0: the series does not continue)."""
    growth_bytes: int
    """What each continued temporary adds to the previous one."""
    last: Transient | None = None
    """The last recorded event of the series the continuation repeats."""

    @cached_property
    def _by_step(self) -> dict[int, Transient]:
        return {event.step: event for event in self.recorded}

    def summary(self) -> dict[str, int | None]:
        temporaries = [event.temporary_bytes for event in self.recorded if event.temporary_bytes]
        return {"events": len(self.recorded), "temporaries": len(temporaries),
                "largest_temporary_bytes": max(temporaries, default=0), "pinning": self.pinned_events,
                "period_steps": self.period or None, "growth_bytes": self.growth_bytes if self.period else None}

    @property
    def pinned_events(self) -> int:
        return sum(1 for event in self.recorded if event.temporary_bytes and event.kept_bytes and event.pinned)

    def at(self, step: int) -> Transient | None:
        """The event to perform before serving step ``step``."""
        if step in self._by_step:
            return self._by_step[step]
        last = self.last
        if not self.period or last is None or step <= self.recorded[-1].step:
            return None
        ahead, remainder = divmod(step - last.step, self.period)
        if ahead <= 0 or remainder:
            return None
        return Transient(step, max(0, last.temporary_bytes + ahead * self.growth_bytes), last.kept_bytes, True)


NO_TRANSIENTS = TransientSeries((), 0, 0)


def transients(serving: list[Sample], graph_limit: int) -> TransientSeries:
    """The transient allocations and long-lived growth of a rank's serving steps (last sample per step).

    ``graph_limit`` is the largest decode batch a captured graph replays (0: eager, every forward
    allocates); only such steps can show a temporary apart from the forward.
    """
    events = []
    previous = slack = None
    for sample in serving:
        allocated = sample.allocated_bytes
        if allocated is None:
            continue
        kept = 0 if previous is None else max(0, allocated - previous)
        pinned = slack is None or sample.inactive_split_bytes is None or sample.inactive_split_bytes > slack
        previous, slack = allocated, sample.inactive_split_bytes
        if sample.step <= 0:
            continue
        temporary = 0
        graph_decode = (sample.step_kind == "decode" and sample.num_seqs is not None
                        and 0 < sample.num_seqs <= graph_limit)
        if graph_decode and sample.peak_is_step and sample.peak_bytes is not None:
            temporary = max(0, sample.peak_bytes - allocated)
        if temporary or kept:
            events.append(Transient(sample.step, temporary, kept, pinned))
    pinning = [event for event in events if event.temporary_bytes and event.kept_bytes and event.pinned]
    last = pinning[-SERIES_MIN_EVENTS:]
    gaps = {b.step - a.step for a, b in pairwise(last)}
    if len(last) < SERIES_MIN_EVENTS or len(gaps) != 1:
        return _keep_alive_series(tuple(events), serving[-1].step if serving else 0)
    growths = sorted(b.temporary_bytes - a.temporary_bytes for a, b in pairwise(last))
    return TransientSeries(tuple(events), gaps.pop(), growths[len(growths) // 2], last[-1])


def _keep_alive_series(events: tuple[Transient, ...], last_step: int) -> TransientSeries:
    """Tensors kept alive at a regular period with no temporary beside them (a leak inside PyTorch), still
    going when the recording ended: the series continues, the same size each period."""
    keeping = [event for event in events if event.kept_bytes and not event.temporary_bytes]
    last = keeping[-KEEP_ALIVE_MIN_EVENTS:]
    gaps = {b.step - a.step for a, b in pairwise(last)}
    if (len(last) < KEEP_ALIVE_MIN_EVENTS or len(gaps) != 1 or len({event.kept_bytes for event in last}) != 1
            or last_step - last[-1].step > next(iter(gaps))):
        return TransientSeries(events, 0, 0)
    return TransientSeries(events, gaps.pop(), 0, last[-1])
