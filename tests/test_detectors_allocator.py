"""What the allocator's signals change: reclaimable cache is free memory, pinned cache is fragmentation,
and retries are reported.

Numbers come from ``SyntheticRun`` with jitter off (see test_detectors_oom for its margin of
7,623,287,296 bytes); the hand-built samples below are one rank sized at 16 GiB.
"""

from __future__ import annotations

from memwatch.detectors import DetectorSet
from memwatch.flags import ALLOC_RETRIES, FRAGMENTATION, INFO, OOM_RISK, WARNING
from memwatch.ledger import Ledger
from memwatch.records import Event, Sample

from synthetic import GiB, MiB, SyntheticRun, kinds, run_flags

SIZING = Event("run", 0, 4, 4, "kv_allocated", {
    "total_bytes": 16 * GiB, "gpu_memory_utilization": 0.9, "used_bytes": 5 * GiB, "peak_bytes": 6 * GiB,
    "current_bytes": 4 * GiB, "block_bytes": 64 * MiB, "num_blocks": 64})
# Budget 14.4 GiB; non-PyTorch 1 GiB, weights 4 GiB, reserve 2 GiB, KV 4 GiB.
LONG_LIVED = 8 * GiB


def _sample(step: int, *, free: int, cached: int, pinned: int, signals: bool = True) -> Sample:
    reserved = LONG_LIVED + cached + pinned
    used = 16 * GiB - free
    extra = dict(segments=50, active_bytes=LONG_LIVED, inactive_split_bytes=pinned, alloc_retries=0, num_ooms=0)
    return Sample("run", 0, step, step, "serve", LONG_LIVED, LONG_LIVED, reserved, used, free,
                  **(extra if signals else {}))


def test_the_ledger_splits_cache_slack_and_credits_whole_free_segments_to_the_margin() -> None:
    ledger = Ledger()
    ledger.on_event(SIZING)
    # 106 MiB free on the driver, 5 GiB of whole free segments cached, 64 MiB pinned.
    terms = ledger.on_sample(_sample(10, free=106 * MiB, cached=5 * GiB, pinned=64 * MiB))
    assert terms.cache_slack_bytes == 5 * GiB + 64 * MiB
    assert (terms.reclaimable_cache_bytes, terms.pinned_cache_bytes) == (5 * GiB, 64 * MiB)
    assert terms.oom_margin_bytes == 106 * MiB + 5 * GiB - 2 * GiB  # free + reclaimable - reserve
    # Without the signals the cache counts only up to the reserve (it may all be fragments).
    old = ledger.on_sample(_sample(11, free=106 * MiB, cached=5 * GiB, pinned=64 * MiB, signals=False))
    assert (old.reclaimable_cache_bytes, old.pinned_cache_bytes) == (None, None)
    assert old.oom_margin_bytes == 106 * MiB


def test_a_cache_of_whole_free_segments_is_neither_fragmentation_nor_an_oom_risk() -> None:
    detectors = DetectorSet()
    detectors.on_event(SIZING)
    flags = []
    # A bursty workload: each prefill a little larger leaves its own whole free segment; the driver's
    # free memory falls to 106 MiB while the cache grows to 6 GiB, all of it reclaimable.
    for step in range(6, 400):
        cached = min(step, 300) * 20 * MiB
        flags += detectors.on_sample(_sample(step, free=6 * GiB + 106 * MiB - cached, cached=cached, pinned=0))
    assert flags == []


def test_the_same_cache_pinned_is_fragmentation() -> None:
    detectors = DetectorSet()
    detectors.on_event(SIZING)
    flags = []
    for step in range(6, 400):
        pinned = min(step, 300) * 20 * MiB
        flags += detectors.on_sample(_sample(step, free=6 * GiB + 106 * MiB - pinned, cached=0, pinned=pinned))
    fragmentation = [flag for flag in flags if flag.kind == FRAGMENTATION]
    # Threshold: max(256 MiB, 2 % of 14.4 GiB, half the 2 GiB reserve) = 1 GiB of growth over the 120 MiB
    # pinned at step 6: 20 MiB x step >= 1 GiB + 120 MiB from step 58; the 20th sample in a row is step 77.
    assert [(flag.step, flag.severity) for flag in fragmentation] == [(77, WARNING)]
    assert fragmentation[0].data["threshold_bytes"] == 1 * GiB
    assert OOM_RISK in {flag.kind for flag in flags}  # and the pinned bytes eat the margin


def test_retries_are_info_once_then_a_warning_when_they_keep_happening() -> None:
    flags = run_flags(SyntheticRun(jitter=False, retries_at=(50, 300, 320, 340), serve_steps=600))
    retries = [(flag.step, flag.severity) for flag in flags if flag.kind == ALLOC_RETRIES]
    # The first retry (i = 50) is info; the one at i = 300 is a new episode after 100+ quiet steps;
    # the third within 500 steps (i = 320: 50, 300, 320) is the warning; i = 340 adds nothing.
    assert retries == [(6 + 50, INFO), (6 + 300, INFO), (6 + 320, WARNING)]
    warning = [flag for flag in flags if flag.kind == ALLOC_RETRIES][-1]
    assert warning.data["retries_since_serving"] == 3 and warning.data["retries_in_window"] == 3


def test_a_single_retry_is_not_a_warning() -> None:
    flags = run_flags(SyntheticRun(jitter=False, retries_at=(100,), serve_steps=400))
    assert kinds(flags) == [(ALLOC_RETRIES, INFO)]
