"""PyTorch memory kept alive across steps that keeps growing while serving: a leak inside PyTorch.

The ledger's ``torch_kept_bytes`` is what stays allocated after a step beyond the weights and the KV
cache (the "other long-lived PyTorch" term, measured on each sample). Tensors held by mistake (logprobs
kept per request, metadata per prefix-cache entry, adapters never freed, a graph pool per new batch
shape) make it rise. KV usage never moves it: KV lives inside the preallocated cache.

``torch_drift`` is raised when both hold:

* the term grew by at least ``torch_drift_min_bytes`` since the first serving sample, and
* it is still rising: the window of ``torch_drift_window_steps`` steps is cut in four blocks, and the
  floor (smallest value) of each block rose over the block before it by at least an eighth of the
  rise over five blocks. One-time growth that levels off (a buffer allocated once, graphs captured for
  a few new batch sizes, a KV cache allocated lazily) moves one block's floor and fails this, however
  large it was; floors ignore what a step leaves behind for a moment. Judged once per block: O(1) per
  sample.

The rate is measured from the onset (the last sample where the growth was under a quarter of the
threshold), and the steps left from the ledger's OOM margin at that rate: ``critical`` when they are
within ``oom_forecast_horizon_steps`` (the leak will end the run), else ``warning``. Re-armed once the
term has stopped rising for ``rearm_steps`` samples.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

from memwatch.detectors.base import Detector, Episode, make_flag
from memwatch.detectors.batch import CLEAR, FIRE, NOT_CLEAR, Plan, apply_episode, episode_plan
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.wording import format_bytes, format_count
from memwatch.flags import CRITICAL, TORCH_DRIFT, WARNING, Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Sample

if TYPE_CHECKING:
    from memwatch.detectors.batch import Columns

_PARTS = 4
"""Blocks of the window whose floors must each rise."""


class TorchDriftDetector(Detector):
    """``torch_drift`` for one rank."""

    __slots__ = ("_baseline", "_baseline_step", "_block", "_block_len", "_block_min", "_episode", "_horizon",
                 "_min", "_minima", "_onset_kept", "_onset_step", "_quiet", "_rising")

    def __init__(self, config: DetectorConfig) -> None:
        self._min = config.torch_drift_min_bytes
        self._quiet = config.torch_drift_min_bytes // 4
        self._horizon = config.oom_forecast_horizon_steps
        self._episode = Episode(config.rearm_steps)
        self._block_len = max(config.torch_drift_window_steps // _PARTS, 1)
        self._block = 0
        self._block_min = 0
        self._minima: deque[int] = deque(maxlen=_PARTS + 1)
        self._rising = False
        self._baseline: int | None = None
        self._baseline_step = self._onset_step = self._onset_kept = 0

    def start(self, sample: Sample, terms: LedgerTerms) -> None:
        if terms.torch_kept_bytes is not None:
            self._begin(terms.torch_kept_bytes, sample.step)

    def _begin(self, kept: int, step: int) -> None:
        self._baseline = self._onset_kept = kept
        self._baseline_step = self._onset_step = step

    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        kept = terms.torch_kept_bytes
        if kept is None:
            return None
        baseline = self._baseline
        if baseline is None:
            self._begin(kept, sample.step)
            baseline = kept
        growth = kept - baseline
        if growth <= self._quiet:
            self._onset_step, self._onset_kept = sample.step, kept
        # The floor of each block of the window: noise and a step's leftovers only add to what is kept, so
        # the floor follows the memory that really stays; a one-time rise moves one block's floor only.
        if self._block == 0 or kept < self._block_min:
            self._block_min = kept
        self._block += 1
        if self._block < self._block_len:
            self._episode.settle(not self._rising)
            return None
        self._block = 0
        minima = self._minima
        minima.append(self._block_min)
        self._rising = len(minima) > 1 and minima[-1] > minima[-2]
        if growth < self._min or len(minima) <= _PARTS or not self._rises_through(minima):
            self._episode.settle(not self._rising)
            return None
        if not self._episode.fire():
            return None
        return self._flag(sample, terms, kept, growth)

    def plan(self, batch: Columns) -> Plan:
        if self._baseline is None:
            return 0
        np, n, block_len = batch.np, batch.n, self._block_len
        kept = batch.kept
        growth = kept - self._baseline
        quiet = np.flatnonzero(growth <= self._quiet)
        block, block_min, rising = self._block, self._block_min, self._rising
        minima = deque(self._minima, maxlen=_PARTS + 1)
        actions = np.empty(n, dtype=np.int64)
        at = 0
        while at < n:  # block by block: within one, every sample settles on the rise the last block left
            end = at + block_len - block  # one past the sample that completes this block
            floor = int(kept[at:min(end, n)].min())
            block_min = floor if block == 0 else min(block_min, floor)
            settle = NOT_CLEAR if rising else CLEAR
            if end > n:
                actions[at:] = settle
                block += n - at
                break
            actions[at:end - 1] = settle
            minima.append(block_min)
            rising = len(minima) > 1 and minima[-1] > minima[-2]
            last = end - 1
            fires = growth[last] >= self._min and len(minima) > _PARTS and self._rises_through(minima)
            actions[last] = FIRE if fires else NOT_CLEAR if rising else CLEAR
            block, at = 0, end
        episode = episode_plan(np, self._episode, actions)
        if isinstance(episode, int):
            return episode

        def commit() -> None:
            if len(quiet):
                last_quiet = int(quiet[-1])
                self._onset_step, self._onset_kept = int(batch.step[last_quiet]), int(kept[last_quiet])
            self._block, self._block_min, self._rising, self._minima = block, block_min, rising, minima
            apply_episode(self._episode, episode)

        return commit

    @staticmethod
    def _rises_through(minima: deque[int]) -> bool:
        """Whether each block's floor rose over the one before by at least an eighth of the whole rise."""
        rise = minima[-1] - minima[0]
        if rise <= 0:
            return False
        share = max(rise >> 3, 1)
        previous = minima[0]
        for value in itertools.islice(minima, 1, None):
            if value - previous < share:
                return False
            previous = value
        return True
    def _flag(self, sample: Sample, terms: LedgerTerms, kept: int, growth: int) -> Flag:
        steps = max(sample.step - self._onset_step, 1)
        grown = kept - self._onset_kept
        rate = grown // steps
        margin = terms.oom_margin_bytes
        steps_left = margin // rate if margin is not None and rate > 0 else None
        severity = CRITICAL if steps_left is not None and steps_left <= self._horizon else WARNING
        words = (f"PyTorch memory that outlives each step grew by {format_bytes(growth)} while serving, "
                 f"{format_bytes(grown)} of it since step {format_count(self._onset_step)} at "
                 f"{format_bytes(rate)}/step")
        if steps_left is not None:
            words += f"; at this rate the device is full in about {format_count(max(steps_left, 0))} steps"
        words += ": look for tensors kept across steps (outputs, logprobs or metadata held per request)"
        return make_flag(sample, TORCH_DRIFT, severity, words, {
            "growth_bytes": growth, "grown_bytes": grown, "steps": steps, "slope_bytes_per_step": rate,
            "onset_step": self._onset_step, "baseline_step": self._baseline_step,
            "baseline_torch_kept_bytes": self._baseline, "torch_kept_bytes": kept,
            "oom_margin_bytes": margin, "steps_left": steps_left,
        })
