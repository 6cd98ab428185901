"""Which margin the oom_risk forecast judges: free memory alone when memory outside PyTorch grows.

A leak outside PyTorch's allocator is a plain ``cudaMalloc``: the allocator never releases its cache
for it, so it fails as soon as the driver's free memory is less than one step's leak. From a point
where the driver has ``free`` bytes and nothing else moves, that is ``free // bytes_per_step`` steps
later. PyTorch's own growth instead gets the cache released and retried before it fails, so there
the reclaimable cache still counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memwatch.detectors import DetectorConfig, replay
from memwatch.detectors.oom import DRIVER_FREE, FREE_AND_RECLAIMABLE, OomRiskDetector
from memwatch.flags import CRITICAL, OOM_RISK, WARNING, Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Sample
from memwatch.sim import Scenario, run_scenario
from memwatch.sim.fault_kinds import NonTorchLeak
from memwatch.sim.scorecard import START_NS, ring_records

MiB = 1 << 20
GiB = 1 << 30


@pytest.mark.parametrize("name", ["non_torch_leak_bursty", "non_torch_leak_h200"])
def test_forecast_of_a_leak_outside_pytorch_is_within_half_and_one_and_a_half_of_the_steps_left(
        name: str, tmp_path: Path) -> None:
    scenario = Scenario.load(name)
    leak = next(fault for fault in scenario.faults if isinstance(fault, NonTorchLeak))
    result = run_scenario(scenario, runtime_dir=tmp_path, start_ns=START_NS)
    crash = next(rank.crash_details for rank in result.ranks if rank.crash_details is not None)
    crash_step = crash["step"]
    risks = [flag for flag in replay(ring_records(result)).flags if flag.kind == OOM_RISK]
    first = risks[0]
    assert first.severity == WARNING
    assert leak.from_step <= first.step < crash_step

    # The leaking cudaMalloc gets only what the driver has free; the cache is never released for it.
    free = first.data["driver_free_bytes"]
    derived = free // leak.bytes_per_step
    left = crash_step - first.step
    assert derived - derived // 10 <= left <= derived + 1, (left, derived)  # the derivation is what happened
    forecast = first.data["steps_to_zero"]
    assert 0.5 * left <= forecast <= 1.5 * left, (forecast, left)
    assert first.data["margin"] == DRIVER_FREE
    assert first.data["judged_margin_bytes"] <= free < first.data["oom_margin_bytes"]
    assert "memory outside PyTorch is growing" in first.message

    critical = [flag for flag in risks if flag.severity == CRITICAL]
    assert critical and critical[0].step < crash_step
    assert critical[0].data["margin"] == DRIVER_FREE
    assert critical[0].data["driver_free_bytes"] < DetectorConfig().oom_margin_min_bytes + leak.bytes_per_step


FREE = 1 * GiB
MARGIN = 5 * GiB  # free plus 4 GiB of reclaimable cache, the next forward's need already taken off
FALL = 8 * MiB


def first_flag(outside: bool, steps: int = 200) -> Flag:
    """A margin falling 8 MiB a step, with the fall in non-PyTorch memory (eating free) or PyTorch's (eating the
    reclaimable cache first, free unchanged)."""
    detector = OomRiskDetector(DetectorConfig())
    for step in range(steps):
        free = FREE - FALL * step if outside else FREE
        non_torch = 1 * GiB + (FALL * step if outside else 0)
        terms = LedgerTerms(*[None] * 12)._replace(oom_margin_bytes=MARGIN - FALL * step, non_torch_bytes=non_torch)
        sample = Sample("run", 0, step, step * 25_000_000, "serve", None, None, None, None, free)
        flag = detector.observe(sample, terms)
        if flag is not None:
            return flag
    raise AssertionError("no flag")


def test_pytorch_growth_counts_the_reclaimable_cache() -> None:
    flag = first_flag(outside=False)
    assert flag.severity == WARNING
    assert flag.data["margin"] == FREE_AND_RECLAIMABLE
    assert flag.data["judged_margin_bytes"] == MARGIN - FALL * flag.step
    assert flag.data["steps_to_zero"] == (MARGIN - FALL * flag.step) // FALL
    assert flag.message.startswith("the OOM margin of ")


def test_growth_outside_pytorch_counts_free_memory_alone() -> None:
    flag = first_flag(outside=True)
    assert flag.severity == WARNING
    assert flag.data["margin"] == DRIVER_FREE
    assert flag.data["judged_margin_bytes"] == FREE - FALL * flag.step
    assert flag.data["steps_to_zero"] == (FREE - FALL * flag.step) // FALL  # 128 steps from the start, not 640
    assert flag.message.startswith("memory outside PyTorch is growing, and PyTorch's cache is not released for it")
