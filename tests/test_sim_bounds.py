"""Bounds each leak scenario implies for the drift flag, derived from the fault and the detector's settings.

A leak of ``bytes_per_step`` from serving step ``from_step`` has grown by ``drift_min_bytes`` at step
``from_step + ceil(drift_min_bytes / bytes_per_step) - 1``. The drift rule may hold a rise back while it
could still be a step change (another process starting): at most ``2 x jump_window_steps +
jump_settle_steps`` samples. So the flag must come in that window after the crossing, and never before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memwatch.detectors import DetectorConfig, replay
from memwatch.flags import NON_TORCH_DRIFT
from memwatch.sim import Scenario, run_scenario
from memwatch.sim.fault_kinds import NonTorchLeak
from memwatch.sim.scorecard import ring_records


@pytest.mark.parametrize("name", ["non_torch_leak", "non_torch_leak_slow", "non_torch_leak_tp2"])
def test_drift_is_flagged_within_the_detectors_window_of_the_leak_crossing_the_threshold(
        name: str, tmp_path: Path) -> None:
    scenario = Scenario.load(name)
    leak = next(fault for fault in scenario.faults if isinstance(fault, NonTorchLeak))
    config = DetectorConfig()
    crossing = leak.from_step + -(-config.drift_min_bytes // leak.bytes_per_step) - 1
    hold = 2 * config.jump_window_steps + config.jump_settle_steps
    flags = replay(ring_records(run_scenario(scenario, runtime_dir=tmp_path))).flags
    drift = [flag for flag in flags if flag.kind == NON_TORCH_DRIFT]
    ranks = range(scenario.engine.tensor_parallel_size) if leak.rank is None else [leak.rank]
    assert sorted(flag.rank for flag in drift) == list(ranks)
    for flag in drift:
        assert crossing <= flag.step <= crossing + hold, (flag.step, crossing)
