"""Memory pinned in partly used segments: the fragmentation that fails big allocations.

The allocator's cache holds two kinds of free memory (see :mod:`memwatch.ledger`). Wholly free
segments are harmless: before it raises an OOM the allocator releases them and retries, so they are
never fragmentation, however many a growing or bursty workload leaves behind. Free blocks inside
segments that still hold a live tensor (``inactive_split_bytes``, the ledger's ``pinned_cache_bytes``)
are: nothing can release them, the driver no longer has them, and only requests that fit a hole can
use them. This detector watches that term alone.

It fires when pinned bytes have grown since serving started by at least the threshold, for
``fragmentation_sustain_steps`` samples. The threshold scales with the GPU and with the forward: the
largest of ``fragmentation_min_bytes``, ``fragmentation_budget_fraction`` of the rank's budget, and
``fragmentation_reserve_ratio`` of the activation reserve (what the worst-case forward needs). Re-armed
once the growth falls under half the threshold. Samples without allocator signals (older rings,
NVML-only runs) are not judged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memwatch.detectors.base import Detector, Episode, make_flag
from memwatch.detectors.batch import CLEAR, FIRE, NOT_CLEAR, Plan, apply_episode, consecutive, episode_plan
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.wording import format_bytes
from memwatch.flags import FRAGMENTATION, WARNING, Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Sample

if TYPE_CHECKING:
    from memwatch.detectors.batch import Columns


def fragmentation_threshold(config: DetectorConfig, budget: int | None, reserve: int | None) -> int:
    """Pinned growth that counts as fragmentation on a rank with this budget and activation reserve."""
    threshold = config.fragmentation_min_bytes
    if budget is not None:
        threshold = max(threshold, int(budget * config.fragmentation_budget_fraction))
    if reserve is not None:
        threshold = max(threshold, int(max(reserve, 0) * config.fragmentation_reserve_ratio))
    return threshold


class FragmentationDetector(Detector):
    """``fragmentation`` for one rank."""

    __slots__ = ("_baseline", "_config", "_episode", "_run", "_sustain", "_threshold")

    def __init__(self, config: DetectorConfig) -> None:
        self._config = config
        self._sustain = config.fragmentation_sustain_steps
        self._episode = Episode(config.rearm_steps)
        self._baseline: int | None = None
        self._threshold: int | None = None
        self._run = 0

    def start(self, sample: Sample, terms: LedgerTerms) -> None:
        self._baseline = terms.pinned_cache_bytes
        self._threshold = fragmentation_threshold(self._config, terms.budget_bytes, terms.activation_reserve_bytes)

    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        pinned = terms.pinned_cache_bytes
        if pinned is None:
            return None
        if self._baseline is None:
            self._baseline = pinned
            return None
        threshold = self._threshold
        if threshold is None:
            threshold = self._threshold = fragmentation_threshold(
                self._config, terms.budget_bytes, terms.activation_reserve_bytes)
        excess = pinned - self._baseline
        if excess < threshold:
            self._run = 0
            self._episode.settle(2 * excess < threshold)
            return None
        self._run += 1
        if self._run < self._sustain:
            self._episode.settle(False)
            return None
        if not self._episode.fire():
            return None
        return self._flag(sample, terms, pinned, excess, threshold)

    def plan(self, batch: Columns) -> Plan:
        if self._baseline is None or self._threshold is None:
            return 0
        np, threshold = batch.np, self._threshold
        excess = batch.pinned - self._baseline
        over = excess >= threshold
        runs = consecutive(np, over, self._run)
        actions = np.where(over, np.where(runs < self._sustain, NOT_CLEAR, FIRE),
                           np.where(2 * excess < threshold, CLEAR, NOT_CLEAR))
        episode = episode_plan(np, self._episode, actions)
        if isinstance(episode, int):
            return episode

        def commit() -> None:
            self._run = int(runs[-1])
            apply_episode(self._episode, episode)

        return commit

    def _flag(self, sample: Sample, terms: LedgerTerms, pinned: int, excess: int, threshold: int) -> Flag:
        free = sample.driver_free_bytes
        reserve = terms.activation_reserve_bytes
        segments = sample.segments
        where = "" if segments is None else f" (the allocator holds {segments:,} segments)"
        need = ""
        if reserve:
            need = f", {pinned / reserve:.1f}× what the worst-case forward needs"
        return make_flag(
            sample, FRAGMENTATION, WARNING,
            f"{format_bytes(pinned)} of the allocator's cache is pinned in partly used segments{where}, "
            f"{format_bytes(excess)} more than when serving started{need}: empty_cache cannot release it, and "
            f"an allocation larger than every hole will fail"
            + ("" if free is None else f" with {format_bytes(free)} free on the device"),
            {"pinned_cache_bytes": pinned, "excess_bytes": excess, "threshold_bytes": threshold,
             "baseline_pinned_cache_bytes": self._baseline,
             "reclaimable_cache_bytes": terms.reclaimable_cache_bytes,
             "cache_slack_bytes": terms.cache_slack_bytes, "activation_reserve_bytes": reserve,
             "segments": segments, "reserved_bytes": sample.reserved_bytes,
             "allocated_bytes": sample.allocated_bytes, "driver_free_bytes": free, "sustained_steps": self._run},
        )
