"""Memory outside PyTorch's allocator that grows after serving started: a slope or a step.

Non-torch memory (driver used minus allocator reserved) holds the CUDA context, NCCL and cuBLAS
workspaces, and every other process on the GPU. Both a leak here and another process show as this
number growing; the shape tells them apart:

* ``external_process``: a rise of at least ``jump_min_bytes`` within ``jump_window_steps`` that then
  stays level (within a quarter of that) for ``jump_settle_steps``: a step change, as when another
  process allocates. A rise that is still going after twice the window plus the settle time is a
  slope and is left to the drift rule; a fall of the same shape (the process ended) is taken off
  the drift silently, and a spike that comes back down is ignored.
* ``non_torch_drift``: growth since the first serving sample, confirmed step changes excluded, of at
  least ``drift_min_bytes``; reported with its slope since the growth began (the last sample where it
  was under a quarter of the threshold). Re-armed once the growth falls under half the threshold.

Both judge against the serving baseline, never against startup, where loading and CUDA-graph
capture move this number by design.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memwatch.detectors.base import Detector, Episode, make_flag
from memwatch.detectors.batch import CLEAR, FIRE, NOT_CLEAR, Plan, apply_episode, episode_plan
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.wording import format_bytes, format_count
from memwatch.flags import EXTERNAL_PROCESS, NON_TORCH_DRIFT, WARNING, Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Sample

if TYPE_CHECKING:
    from memwatch.detectors.batch import Columns

_NO_JUMP = -1


class NonTorchDetector(Detector):
    """``non_torch_drift`` and ``external_process`` for one rank."""

    __slots__ = (
        "_baseline", "_drift", "_drift_min", "_jump_min", "_jump_step", "_jumps", "_level", "_level_step",
        "_onset_growth", "_onset_step", "_pending_age", "_pending_limit", "_quiet", "_ring", "_ring_index",
        "_ring_steps", "_settle_steps", "_settled", "_start_step", "_start_value",
    )

    def __init__(self, config: DetectorConfig) -> None:
        self._drift_min = config.drift_min_bytes
        self._quiet = config.drift_min_bytes // 4
        self._drift = Episode(config.rearm_steps)
        self._jump_min = config.jump_min_bytes
        self._jump_step = config.jump_min_bytes // 4
        self._settle_steps = config.jump_settle_steps
        self._pending_limit = 2 * config.jump_window_steps + config.jump_settle_steps
        self._ring = [0] * config.jump_window_steps
        self._ring_steps = [0] * config.jump_window_steps
        self._ring_index = 0
        self._baseline: int | None = None
        self._jumps = 0
        self._onset_step = 0
        self._onset_growth = 0
        self._pending_age = _NO_JUMP
        self._start_value = self._start_step = self._level = self._level_step = self._settled = 0

    def _begin(self, non_torch: int, step: int) -> None:
        self._baseline = non_torch
        self._onset_step = step
        self._reset_ring(non_torch, step)

    def _reset_ring(self, non_torch: int, step: int) -> None:
        ring, steps = self._ring, self._ring_steps
        for position in range(len(ring)):
            ring[position] = non_torch
            steps[position] = step

    def start(self, sample: Sample, terms: LedgerTerms) -> None:
        if terms.non_torch_bytes is not None:
            self._begin(terms.non_torch_bytes, sample.step)

    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        non_torch = terms.non_torch_bytes
        if non_torch is None:
            return None
        if self._baseline is None:
            self._begin(non_torch, sample.step)
            return None
        jump_flag = self._watch_steps(sample, non_torch)
        drift_flag = self._watch_drift(sample, non_torch)
        return jump_flag if jump_flag is not None else drift_flag

    def plan(self, batch: Columns) -> Plan:
        if self._baseline is None or self._pending_age != _NO_JUMP:
            return 0
        np, n = batch.np, batch.n
        ring, ring_steps, index, width = self._ring, self._ring_steps, self._ring_index, len(self._ring)
        order = [(index + k) % width for k in range(width)]  # oldest first
        values = np.concatenate((np.array([ring[k] for k in order], dtype=np.int64), batch.non_torch))
        jumps = (np.abs(batch.non_torch - values[:n]) >= self._jump_min).nonzero()[0]
        if len(jumps):
            return int(jumps[0])  # a step change may start there: sample by sample
        growth = batch.non_torch - self._baseline - self._jumps
        quiet = (growth <= self._quiet).nonzero()[0]
        drift_min = self._drift_min
        actions = np.where(growth >= drift_min, FIRE, np.where(2 * growth < drift_min, CLEAR, NOT_CLEAR))
        drift = episode_plan(np, self._drift, actions)
        if isinstance(drift, int):
            return drift

        def commit() -> None:
            steps = [ring_steps[k] for k in order] + batch.step.tolist()
            for k in range(width):
                position = (index + n + k) % width
                ring[position] = int(values[n + k])
                ring_steps[position] = steps[n + k]
            self._ring_index = (index + n) % width
            if len(quiet):
                last = int(quiet[-1])
                self._onset_step, self._onset_growth = int(batch.step[last]), int(growth[last])
            apply_episode(self._drift, drift)

        return commit

    def _watch_steps(self, sample: Sample, non_torch: int) -> Flag | None:
        step = sample.step
        ring, index = self._ring, self._ring_index
        window_start, window_start_step = ring[index], self._ring_steps[index]
        ring[index] = non_torch
        self._ring_steps[index] = step
        self._ring_index = index + 1 if index + 1 < len(ring) else 0

        if self._pending_age == _NO_JUMP:
            rise = non_torch - window_start
            if rise >= self._jump_min or -rise >= self._jump_min:
                self._pending_age = 0
                self._settled = 0
                self._start_value, self._start_step = window_start, window_start_step
                self._level, self._level_step = non_torch, step
            return None

        self._pending_age += 1
        if abs(non_torch - self._level) >= self._jump_step:
            self._level, self._level_step = non_torch, step
            self._settled = 0
        else:
            self._settled += 1
        if self._pending_age > self._pending_limit:
            self._pending_age = _NO_JUMP  # still rising: a slope, which the drift rule judges
            return None
        if self._settled < self._settle_steps:
            return None

        self._pending_age = _NO_JUMP
        change = non_torch - self._start_value
        self._reset_ring(non_torch, step)
        if 2 * abs(change) < self._jump_min:
            return None  # a spike that went back down
        self._jumps += change
        if change < 0:
            return None  # memory released, e.g. the other process ended
        steps = max(self._level_step - self._start_step, 1)
        return make_flag(
            sample, EXTERNAL_PROCESS, WARNING,
            f"memory outside this process's allocator jumped by {format_bytes(change)} within "
            f"{format_count(steps)} steps and stayed there: another process is likely using this GPU",
            {"jump_bytes": change, "from_step": self._start_step, "non_torch_bytes": non_torch,
             "baseline_non_torch_bytes": self._baseline, "driver_used_bytes": sample.driver_used_bytes},
        )

    def _watch_drift(self, sample: Sample, non_torch: int) -> Flag | None:
        growth = non_torch - self._baseline - self._jumps  # type: ignore[operator]
        if growth <= self._quiet:
            self._onset_step, self._onset_growth = sample.step, growth
        judged = growth
        if self._pending_age != _NO_JUMP:
            judged -= non_torch - self._start_value  # a step change may be under way: not drift
        if judged < self._drift_min:
            self._drift.settle(2 * judged < self._drift_min)
            return None
        if not self._drift.fire():
            return None
        grown = growth - self._onset_growth
        steps = max(sample.step - self._onset_step, 1)
        slope = grown // steps
        return make_flag(
            sample, NON_TORCH_DRIFT, WARNING,
            f"non-PyTorch memory grew by {format_bytes(growth)} while serving, {format_bytes(slope)}/step "
            f"over the last {format_count(steps)} steps",
            {"growth_bytes": growth, "grown_bytes": grown, "steps": steps, "slope_bytes_per_step": slope,
             "onset_step": self._onset_step, "baseline_non_torch_bytes": self._baseline,
             "non_torch_bytes": non_torch, "step_change_bytes": self._jumps},
        )
