"""torch_drift at the edges the other tests leave open: block and re-arm lengths that do not divide evenly,
leaks of a few bytes, an OOM margin already spent, what the flag reports, and where a batch's plan stops.

Streams are fed straight to one detector as in test_detector_boundaries (whose helpers are reused):
serving sample ``k`` is step ``10 + k``; ``torch_drift_window_steps=8`` gives blocks of 2 samples.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
from test_detector_boundaries import (
    BASE,
    FIRST_STEP,
    LEAK,
    _drift_config,
    _drift_flags,
    _drift_state,
    _kept,
    _planned_drift,
    _sample,
    _terms,
)

from memwatch.detectors import DetectorConfig
from memwatch.detectors.batch import Columns
from memwatch.detectors.torch_drift import TorchDriftDetector
from memwatch.flags import CRITICAL, TORCH_DRIFT, WARNING

from synthetic import MiB

# --- block and re-arm lengths ---------------------------------------------------------------------------------


def test_a_window_of_four_steps_judges_blocks_of_one_sample() -> None:
    # 4 // 4 = 1: every sample is a block, so floors 0, 8, 16, 24, 32 MiB on samples 0..4 make the first
    # window of five rising floors at sample 4 (blocks of 2 would need sample 9).
    config = DetectorConfig(torch_drift_window_steps=4, rearm_steps=6, torch_drift_min_bytes=16 * MiB)
    flags = _drift_flags([BASE + floor * MiB for floor in LEAK], config)
    assert [(flag.step, flag.data["steps"], flag.data["slope_bytes_per_step"]) for flag in flags] == [
        (FIRST_STEP + 4, 4, 8 * MiB)]


# A leak, ONE flat block (block 5, 32 MiB), then floors rising again from 40 MiB. Blocks 6..8 keep the flat
# block in their window (32 -> 32 does not rise), so only block 9's window (32, 40, 48, 56, 64) rises throughout.
ONE_FLAT = [*LEAK, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("rearm_steps", [2, 3])
def test_rearm_steps_short_of_two_blocks_rearm_after_one_flat_block(rearm_steps: int) -> None:
    # 2 and 3 steps hold one whole block of 2: block 5 alone re-arms, and block 9 raises again (sample 19).
    config = DetectorConfig(torch_drift_window_steps=8, rearm_steps=rearm_steps, torch_drift_min_bytes=16 * MiB)
    flags = _drift_flags(_kept(ONE_FLAT), config)
    assert [flag.step for flag in flags] == [FIRST_STEP + 9, FIRST_STEP + 19]
    assert flags[1].data["growth_bytes"] == 64 * MiB


def test_rearm_steps_of_two_whole_blocks_need_two_flat_blocks() -> None:
    # 4 steps = 2 blocks: the one flat block is not enough, so only the first leak is raised.
    config = DetectorConfig(torch_drift_window_steps=8, rearm_steps=4, torch_drift_min_bytes=16 * MiB)
    assert [flag.step for flag in _drift_flags(_kept(ONE_FLAT), config)] == [FIRST_STEP + 9]


def test_rearm_steps_between_two_and_three_blocks_rearm_after_two() -> None:
    # 5 steps hold 2 whole blocks of 2: flat blocks 5 and 6 re-arm; block 10's window (6..10: 32, 40, 48, 56,
    # 64 MiB) rises throughout and raises again at sample 21.
    config = DetectorConfig(torch_drift_window_steps=8, rearm_steps=5, torch_drift_min_bytes=16 * MiB)
    flags = _drift_flags(_kept([*LEAK, 32, 32, 40, 48, 56, 64]), config)
    assert [flag.step for flag in flags] == [FIRST_STEP + 9, FIRST_STEP + 21]


# --- leaks of a few bytes -------------------------------------------------------------------------------------


def _bytes(floors: list[int]) -> list[int]:
    """Two samples per block, both at the floor: ``BASE`` plus so many bytes."""
    return [BASE + floor for floor in floors for _ in range(2)]


def _byte_config(min_bytes: int) -> DetectorConfig:
    return DetectorConfig(torch_drift_window_steps=8, rearm_steps=6, torch_drift_min_bytes=min_bytes,
                          oom_forecast_horizon_steps=100)


def test_floors_rising_a_byte_a_block_are_drift_at_no_measurable_rate() -> None:
    # Whole rise 4 bytes: an eighth is 0, so each floor must rise by at least 1 byte, which each does.
    # 4 bytes over the window's 8 steps is 0 bytes a step: no forecast, so a warning however small the margin.
    flags = _drift_flags(_bytes([0, 1, 2, 3, 4]), _byte_config(4), margin=100)
    assert len(flags) == 1
    assert flags[0].step == FIRST_STEP + 9
    assert (flags[0].data["slope_bytes_per_step"], flags[0].data["steps_left"], flags[0].severity) == (
        0, None, WARNING)
    assert "at this rate" not in flags[0].message


def test_floors_rising_two_bytes_a_block_give_a_byte_a_step_and_a_forecast() -> None:
    # 8 bytes over 8 steps: 1 byte a step; a margin of 50 bytes is 50 steps, within the 100-step horizon.
    flags = _drift_flags(_bytes([0, 2, 4, 6, 8]), _byte_config(8), margin=50)
    assert len(flags) == 1
    assert (flags[0].data["slope_bytes_per_step"], flags[0].data["steps_left"], flags[0].severity) == (
        1, 50, CRITICAL)
    assert "full in about 50 steps" in flags[0].message


def test_a_floor_that_does_not_rise_by_a_byte_is_not_drift() -> None:
    # Whole rise 4 bytes, but block 1 is flat: the rise of at least one byte a block fails.
    assert _drift_flags(_bytes([0, 0, 2, 3, 4]), _byte_config(4), margin=100) == []


# --- what the flag reports ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("margin", "steps_left"), [
    (0, 0),  # nothing left: full now
    (-4 * MiB, -1),  # already 4 MiB over at 4 MiB/step: -1 step, said as 0
])
def test_a_spent_margin_is_critical_and_said_as_zero_steps(margin: int, steps_left: int) -> None:
    # Floors 0..32 MiB, each block's second sample 4 MiB above its floor: at sample 9 kept is BASE + 36 MiB,
    # 36 MiB over the level at step 10; the rate is that of the floors, 32 MiB over 8 steps.
    flags = _drift_flags(_kept(LEAK, lift_mib=4), _drift_config(), margin=margin)
    assert len(flags) == 1
    flag = flags[0]
    assert (flag.kind, flag.step, flag.severity) == (TORCH_DRIFT, FIRST_STEP + 9, CRITICAL)
    assert flag.data["torch_kept_bytes"] == BASE + 36 * MiB
    assert flag.data["growth_bytes"] == 36 * MiB
    assert (flag.data["oom_margin_bytes"], flag.data["steps_left"]) == (margin, steps_left)
    assert flag.message == ("PyTorch memory that outlives each step grew by 36.0 MiB over its level when serving "
                            "began (step 10), at 4.0 MiB/step over the last 8 steps; at this rate the device is "
                            "full in about 0 steps: look for tensors kept across steps (outputs, logprobs or "
                            "metadata held per request)")


# --- where a batch's plan stops -------------------------------------------------------------------------------


def _started(kept: list[int], config: DetectorConfig) -> TorchDriftDetector:
    """A detector started on sample 0 and fed it, as the detector set does before batching."""
    detector = TorchDriftDetector(config)
    detector.start(_sample(0), _terms(kept[0]))
    assert detector.observe(_sample(0), _terms(kept[0])) is None
    return detector


def _plan(detector: TorchDriftDetector, kept: list[int], start: int, stop: int) -> object:
    columns = SimpleNamespace(np=np, n=stop - start, kept=np.array(kept[start:stop], dtype=np.int64),
                              step=np.arange(FIRST_STEP + start, FIRST_STEP + stop, dtype=np.int64))
    return detector.plan(cast(Columns, columns))


def test_a_plan_stops_exactly_at_the_first_flag() -> None:
    # Samples 1..11 of a leak: the flag is at sample 9, index 8 of the batch; block 3 (sample 7), with only
    # four floors, is no reason to stop.
    kept = _kept([*LEAK, 40])
    assert _plan(_started(kept, _drift_config()), kept, 1, 12) == 8
    # up to sample 8 nothing is raised: the plan covers it all
    assert callable(_plan(_started(kept, _drift_config()), kept, 1, 9))


def test_a_plan_covers_a_whole_leak_below_the_minimum() -> None:
    # Floors rise through every window, but 48 MiB is short of the 64 MiB minimum: no flag, so no stop.
    kept = _kept([*LEAK, 40, 48])
    config = _drift_config(min_mib=64)
    detector = _started(kept, config)
    plan = _plan(detector, kept, 1, len(kept))
    assert callable(plan)
    plan()
    assert _drift_flags(kept, config) == []
    reference = _started(kept, config)
    assert [reference.observe(_sample(k), _terms(value)) for k, value in enumerate(kept[1:], 1)] == [None] * 13
    assert _drift_state(detector) == _drift_state(reference)


@pytest.mark.parametrize("chunk", [3, 5, 64])
@pytest.mark.parametrize("floors", [
    # two flat blocks, then floors rising: block 7 (40 MiB) is above block 6 and restarts the count
    pytest.param([*LEAK, 32, 32, 40, 48, 56, 64, 72], id="short-of-rearm"),
    # a drop after the leak counts as clear
    pytest.param([*LEAK, 16, 16, 16, 24, 32, 40, 48, 56], id="drop-then-leak"),
])
def test_batched_rearm_counting_equals_the_per_sample_detector(floors: list[int], chunk: int) -> None:
    kept = _kept(floors)
    config = _drift_config()
    reference = _started(kept, config)
    expected = [reference.observe(_sample(k), _terms(value)) for k, value in enumerate(kept[1:], 1)]
    flags, state, _ = _planned_drift(list(kept), config, chunk)
    assert flags == [flag for flag in expected if flag is not None]
    assert state == _drift_state(reference)
