"""Allocator cache slack growing past what serving needs: the fragmentation that fails big allocations.

While serving, the caching allocator holds the blocks the last forwards freed; a forward of the
worst case frees at most the activation reserve, and batches that grow (4K, 8K, 16K tokens) each
leave a cached segment of their own size, which add up to at most about twice the largest. So
slack up to the serving baseline plus twice the reserve is expected. Slack above that, sustained
for ``fragmentation_sustain_steps`` samples and at least ``fragmentation_min_bytes``, is memory the
driver no longer has and no tensor uses: a large allocation may find no piece big enough and fail
while "free" still looks fine. Re-armed once the excess falls under half the threshold (an
``empty_cache()`` or a quieter workload).
"""

from __future__ import annotations

from memwatch.detectors.base import Detector, Episode, make_flag
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.wording import format_bytes
from memwatch.flags import FRAGMENTATION, WARNING, Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Sample


class FragmentationDetector(Detector):
    """``fragmentation`` for one rank."""

    __slots__ = ("_baseline", "_episode", "_min", "_run", "_sustain")

    def __init__(self, config: DetectorConfig) -> None:
        self._min = config.fragmentation_min_bytes
        self._sustain = config.fragmentation_sustain_steps
        self._episode = Episode(config.rearm_steps)
        self._baseline: int | None = None
        self._run = 0

    def start(self, sample: Sample, terms: LedgerTerms) -> None:
        self._baseline = terms.cache_slack_bytes

    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        slack = terms.cache_slack_bytes
        reserve = terms.activation_reserve_bytes
        if slack is None or reserve is None:
            return None
        if self._baseline is None:
            self._baseline = slack
            return None
        expected = self._baseline + 2 * max(reserve, 0)
        excess = slack - expected
        if excess < self._min:
            self._run = 0
            self._episode.settle(2 * excess < self._min)
            return None
        self._run += 1
        if self._run < self._sustain:
            self._episode.settle(False)
            return None
        if not self._episode.fire():
            return None
        free = sample.driver_free_bytes
        free_words = "" if free is None else f" with {format_bytes(free)} free on the device"
        return make_flag(
            sample, FRAGMENTATION, WARNING,
            f"the allocator caches {format_bytes(slack)} that no tensor uses, {format_bytes(excess)} more "
            f"than serving needs: a large allocation may fail{free_words}",
            {"cache_slack_bytes": slack, "excess_bytes": excess, "expected_slack_bytes": expected,
             "baseline_cache_slack_bytes": self._baseline, "activation_reserve_bytes": reserve,
             "reserved_bytes": sample.reserved_bytes, "allocated_bytes": sample.allocated_bytes,
             "driver_free_bytes": free, "sustained_steps": self._run},
        )
