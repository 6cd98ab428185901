"""The shipped scenarios on which reading cache slack as one number misfired, from the workload up.

Before the allocator's signals, a sample carried only ``reserved − allocated``, and two rules read it:
``fragmentation`` when that slack grew past the serving baseline plus twice the activation reserve by
1 GiB for 20 samples, and an OOM margin that credited slack only up to the reserve (``free`` once the
slack covers it), critical under 256 MiB. Each test below runs a shipped scenario through the per-tensor
allocator simulation and shows both halves: the recorded samples put that old rule in the wrong (the
situation the scenario exists for still arises), and the detectors now say the right thing. The old rule
is written out here, not imported: it is the yardstick, and no production code keeps it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from memwatch.detectors import replay
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.fragmentation import fragmentation_threshold
from memwatch.flags import FRAGMENTATION, OOM, OOM_RISK
from memwatch.ledger import Ledger, LedgerTerms
from memwatch.records import Event, Sample
from memwatch.sim import Scenario, run_scenario
from memwatch.sim.result import SimulationResult
from memwatch.sim.scorecard import START_NS, ring_records

GiB = 1 << 30
MiB = 1 << 20
OLD_FRAGMENTATION_MIN = 1 * GiB
OLD_SUSTAIN = 20
OLD_MARGIN_MIN = 256 * MiB


class Serving(NamedTuple):
    sample: Sample
    terms: LedgerTerms


class Recorded(NamedTuple):
    scenario: Scenario
    result: SimulationResult
    records: list[Sample | Event]
    serving: list[Serving]
    """Rank 0's serving samples with their ledger terms."""


def _record(name: str, tmp_path: Path) -> Recorded:
    scenario = Scenario.load(name)
    result = run_scenario(scenario, runtime_dir=tmp_path / name, start_ns=START_NS)
    records = ring_records(result)
    ledger, serving = Ledger(), []
    for record in records:
        if record.rank != 0:
            continue
        if isinstance(record, Event):
            ledger.on_event(record)
            continue
        terms = ledger.on_sample(record)
        if record.phase == "serve":
            serving.append(Serving(record, terms))
    assert len(serving) > 100
    return Recorded(scenario, result, records, serving)


def _old_fragmentation_steps(serving: list[Serving]) -> Iterator[int]:
    """Steps at which the old slack rule held for its 20th sample in a row (or more)."""
    baseline = serving[0].terms.cache_slack_bytes
    run = 0
    for sample, terms in serving[1:]:
        assert terms.cache_slack_bytes is not None and terms.activation_reserve_bytes is not None
        excess = terms.cache_slack_bytes - (baseline + 2 * terms.activation_reserve_bytes)
        run = run + 1 if excess >= OLD_FRAGMENTATION_MIN else 0
        if run >= OLD_SUSTAIN:
            yield sample.step


def _old_margin(sample: Sample, terms: LedgerTerms) -> int:
    slack, reserve = terms.cache_slack_bytes, terms.activation_reserve_bytes
    assert slack is not None and reserve is not None and sample.driver_free_bytes is not None
    free = sample.driver_free_bytes
    return free - reserve + slack if slack < reserve else free


def _kinds(recorded: Recorded) -> dict[str, int]:
    """Each flag kind raised on the run, with the step it was first raised."""
    firsts: dict[str, int] = {}
    for flag in replay(recorded.records).flags:
        firsts.setdefault(flag.kind, flag.step)
    return firsts


@pytest.mark.parametrize(("name", "expected"), [("clean_bursty", {}), ("chunked_prompt", {"activation_over_reserve"})])
def test_whole_free_segments_past_twice_the_reserve_are_not_fragmentation(name: str, expected: set[str],
                                                                          tmp_path: Path) -> None:
    recorded = _record(name, tmp_path)
    # The old rule fired on these samples: cached slack past the baseline + 2 x reserve + 1 GiB, sustained ...
    assert next(_old_fragmentation_steps(recorded.serving), None) is not None
    # ... though every byte of that growth was in wholly free segments: pinned cache never grew by the new
    # threshold, and the reclaimable cache alone was past the old one.
    first = recorded.serving[0].terms
    threshold = fragmentation_threshold(DetectorConfig(), first.budget_bytes, first.activation_reserve_bytes)
    assert first.pinned_cache_bytes is not None and first.activation_reserve_bytes is not None
    assert max(terms.pinned_cache_bytes - first.pinned_cache_bytes for _, terms in recorded.serving) < threshold  # type: ignore[operator]
    assert max(terms.reclaimable_cache_bytes for _, terms in recorded.serving) > (  # type: ignore[type-var]
        2 * first.activation_reserve_bytes + OLD_FRAGMENTATION_MIN)
    assert recorded.result.status == "ok"
    assert set(_kinds(recorded)) == set(expected)


def test_a_driver_nearly_full_of_cached_segments_is_not_an_oom_risk(tmp_path: Path) -> None:
    recorded = _record("clean_cache_full", tmp_path)
    serving = recorded.serving
    # The old margin went critical: the driver had under 256 MiB free, the slack covered the reserve, and
    # the margin read the driver's free memory alone ...
    low = next(i for i, (sample, terms) in enumerate(serving) if _old_margin(sample, terms) < OLD_MARGIN_MIN)
    sample, terms = serving[low]
    assert terms.reclaimable_cache_bytes is not None and terms.activation_reserve_bytes is not None
    assert terms.reclaimable_cache_bytes >= terms.activation_reserve_bytes
    # ... then a later forward needed a segment the driver lacked, and the allocator released cached ones
    # for it (reserved fell, the driver had more free) with no retry, and the run went on.
    after = next(later for later, _ in serving[low + 1:] if later.reserved_bytes < sample.reserved_bytes)  # type: ignore[operator]
    assert after.driver_free_bytes > sample.driver_free_bytes  # type: ignore[operator]
    assert serving[-1].sample.alloc_retries == 0 and recorded.result.status == "ok"
    # Counting whole free segments as free, the margin never came near the threshold, and nothing was raised.
    assert min(terms.oom_margin_bytes for _, terms in serving) > OLD_MARGIN_MIN  # type: ignore[type-var]
    assert _kinds(recorded) == {}


def test_pinned_segments_on_a_large_card_are_fragmentation_before_the_oom(tmp_path: Path) -> None:
    recorded = _record("fragmentation_80g", tmp_path)
    serving = recorded.serving
    first = serving[0]
    reserve, baseline = first.terms.activation_reserve_bytes, first.terms.cache_slack_bytes
    assert reserve is not None and baseline is not None and first.sample.driver_free_bytes is not None
    # The old threshold was out of reach: it asked for more cache than the driver had free when serving
    # started, so the old rule could not fire however the cache filled ...
    assert first.sample.driver_free_bytes + baseline < baseline + 2 * reserve + OLD_FRAGMENTATION_MIN
    assert next(_old_fragmentation_steps(serving), None) is None
    # ... and the run ended in an allocator OOM with GiB reserved but unallocated, nearly all of it pinned
    # in partly used segments. The pinned segments are what filled the driver: at least half of what it had
    # free when serving started (5 % of 80 GB plus the reserve, about 7 GiB), in segments of at most
    # 160 MiB + 2 MiB a step, 300 MiB at the very most, so at least 7 GiB / 2 / 300 MiB = 12 of them.
    [rank] = recorded.result.ranks
    oom = rank.oom_details
    assert recorded.result.status == "oom" and oom is not None
    free_at_start = first.sample.driver_free_bytes
    unallocated = oom["reserved_bytes"] - oom["allocated_bytes"]
    assert unallocated > free_at_start / 2 and oom["inactive_split_bytes"] > 0.9 * unallocated
    assert oom["segments"] - first.sample.segments >= free_at_start // 2 // (300 * MiB)  # type: ignore[operator]
    # fragmentation, from the pinned bytes, comes before the OOM (and after the fault starts).
    firsts = _kinds(recorded)
    fault_step = recorded.scenario.faults[0].start_step
    assert fault_step < firsts[FRAGMENTATION] < firsts[OOM] and firsts[OOM_RISK] >= fault_step
