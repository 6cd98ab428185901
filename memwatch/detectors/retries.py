"""Allocator retries while serving: each one is a cache flush and a latency spike.

When ``cudaMalloc`` fails, PyTorch's caching allocator releases every wholly free cached segment
(synchronising the device) and tries again; only if that fails too does it raise an OOM. The retry
succeeds, so nothing fails and no other tool reports it, but the step that hit it stalled and the
cache it had built is gone. ``num_alloc_retries`` counts them (cumulative, per process).

* ``info`` on the first retry after serving started: the GPU is running at its edge. A retry that
  failed (the OOM count rose with it) is the out-of-memory itself, which ``oom`` reports.
* ``warning`` when retries keep happening: ``alloc_retries_warning_count`` of them within
  ``alloc_retries_window_steps`` steps. Each flag re-arms after ``rearm_steps`` steps without a retry.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from memwatch.detectors.base import Detector, Episode, make_flag
from memwatch.detectors.batch import CLEAR, NOT_CLEAR, Plan, apply_episode, episode_plan
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.wording import format_bytes, format_count
from memwatch.flags import ALLOC_RETRIES, INFO, WARNING, Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Sample

if TYPE_CHECKING:
    from memwatch.detectors.batch import Columns


class AllocRetriesDetector(Detector):
    """``alloc_retries`` for one rank."""

    __slots__ = ("_baseline", "_count", "_first", "_last", "_last_ooms", "_recent", "_repeated", "_window")

    def __init__(self, config: DetectorConfig) -> None:
        self._count = config.alloc_retries_warning_count
        self._window = config.alloc_retries_window_steps
        self._first = Episode(config.rearm_steps)
        self._repeated = Episode(config.rearm_steps)
        self._recent: deque[int] = deque(maxlen=self._count)
        self._baseline: int | None = None
        self._last: int | None = None
        self._last_ooms: int | None = None

    def start(self, sample: Sample, terms: LedgerTerms) -> None:
        self._baseline = self._last = sample.alloc_retries
        self._last_ooms = sample.num_ooms

    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        retries = sample.alloc_retries
        if retries is None:
            return None
        last = self._last
        self._last = retries
        if last is None:
            self._baseline = retries
            return None
        new = retries - last
        ooms, last_ooms = sample.num_ooms, self._last_ooms
        self._last_ooms = ooms
        if ooms is not None and last_ooms is not None and ooms > last_ooms:
            new -= ooms - last_ooms  # a retry that failed is the OOM itself, reported as such
        if new <= 0:
            self._first.settle(True)
            recent = self._recent
            self._repeated.settle(len(recent) < self._count or sample.step - recent[0] > self._window)
            return None
        recent = self._recent
        for _ in range(min(new, self._count)):
            recent.append(sample.step)
        repeated = len(recent) == self._count and sample.step - recent[0] <= self._window
        if repeated:
            self._first.fire()
            if self._repeated.fire():
                return self._flag(sample, terms, retries, WARNING)
            return None
        if self._first.fire():
            return self._flag(sample, terms, retries, INFO)
        return None

    def plan(self, batch: Columns) -> Plan:
        if self._last is None or self._last_ooms is None:
            return 0
        np = batch.np
        retries, ooms = batch.retries, batch.num_ooms
        new = retries - np.concatenate(([self._last], retries[:-1]))  # np.diff with prepend, cheaper
        ooms_new = ooms - np.concatenate(([self._last_ooms], ooms[:-1]))
        new = new - np.where(ooms_new > 0, ooms_new, 0)
        retried = (new > 0).nonzero()[0]
        if len(retried):
            return int(retried[0])  # a retry: sample by sample
        clear = np.full(batch.n, CLEAR, dtype=np.int64)
        first = episode_plan(np, self._first, clear)
        recent = self._recent
        if len(recent) < self._count:
            repeated_actions = clear
        else:
            repeated_actions = np.where(batch.step - recent[0] > self._window, CLEAR, NOT_CLEAR)
        repeated = episode_plan(np, self._repeated, repeated_actions)
        if isinstance(first, int) or isinstance(repeated, int):  # never: a batch without retries only settles
            return min(value for value in (first, repeated) if isinstance(value, int))

        def commit() -> None:
            self._last, self._last_ooms = int(retries[-1]), int(ooms[-1])
            apply_episode(self._first, first)
            apply_episode(self._repeated, repeated)

        return commit

    def _flag(self, sample: Sample, terms: LedgerTerms, retries: int, severity: str) -> Flag:
        since = retries - (self._baseline or 0)
        if severity == WARNING:
            words = (f"the allocator flushed its cache and retried a failed cudaMalloc "
                     f"{format_count(len(self._recent))} times within {format_count(self._window)} steps "
                     f"({format_count(since)} since serving started): each retry stalls the step and drops the "
                     f"cache; the GPU is too full for this load")
        else:
            words = ("the allocator flushed its cache and retried a failed cudaMalloc: that step stalled; memory is "
                     "at its edge")
        free = sample.driver_free_bytes
        if free is not None:
            words += f" ({format_bytes(free)} free on the device now)"
        return make_flag(sample, ALLOC_RETRIES, severity, words, {
            "alloc_retries": retries, "retries_since_serving": since, "window_steps": self._window,
            "retries_in_window": len(self._recent) if severity == WARNING else 1,
            "reserved_bytes": sample.reserved_bytes, "allocated_bytes": sample.allocated_bytes,
            "driver_free_bytes": free, "reclaimable_cache_bytes": terms.reclaimable_cache_bytes,
        })
