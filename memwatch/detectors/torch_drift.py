"""PyTorch memory kept alive across steps that keeps growing while serving: a leak inside PyTorch.

The ledger's ``torch_kept_bytes`` is what stays allocated after a step beyond the weights and the KV
cache (the "other long-lived PyTorch" term, measured on each sample). Tensors held by mistake (logprobs
kept per request, metadata per prefix-cache entry, adapters never freed, a graph pool per new batch
shape) make it rise. KV usage never moves it: KV lives inside the preallocated cache.

``torch_drift`` is raised when both hold:

* the term grew by at least ``torch_drift_min_bytes`` since the first serving sample, and
* it is still rising: serving is cut in blocks of a quarter of ``torch_drift_window_steps`` steps, and
  over the last five blocks the floor (smallest value) of each rose over the one before it by at
  least an eighth of the rise from the first floor to the last (``torch_drift_window_steps`` apart).
  One-time growth that levels off (a buffer allocated once, graphs captured for a few new batch
  sizes, a KV cache allocated lazily) moves one block's floor and fails this, however large it was;
  floors ignore what a step leaves behind for a moment. Judged once per block: O(1) per sample.

The rate is the rise of the block floors over the window (exact for a steady leak, and blind to the
steps before it began), and the steps left are the ledger's OOM margin at that rate: ``critical`` when
they are within ``oom_forecast_horizon_steps`` (the leak will end the run), else ``warning``. Re-armed
once the floors have stopped rising for ``rearm_steps`` steps.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

from memwatch.detectors.base import Detector, Episode, make_flag
from memwatch.detectors.batch import CLEAR, FIRE, NOT_CLEAR, SKIP, Plan, apply_episode, episode_plan
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.wording import format_bytes, format_count
from memwatch.flags import CRITICAL, TORCH_DRIFT, WARNING, Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Sample

if TYPE_CHECKING:
    from memwatch.detectors.batch import Columns

_PARTS = 4
"""Blocks of the window whose floors must each rise."""
_NO_MIN = 1 << 62


class TorchDriftDetector(Detector):
    """``torch_drift`` for one rank."""

    __slots__ = ("_baseline", "_baseline_step", "_block_len", "_block_min", "_episode", "_horizon", "_left",
                 "_min", "_minima")

    def __init__(self, config: DetectorConfig) -> None:
        self._min = config.torch_drift_min_bytes
        self._horizon = config.oom_forecast_horizon_steps
        self._block_len = max(config.torch_drift_window_steps // _PARTS, 1)
        # Judged once per block, so re-armed after ``rearm_steps`` steps' worth of blocks that did not rise.
        self._episode = Episode(max(config.rearm_steps // self._block_len, 1))
        self._left = self._block_len
        self._block_min = _NO_MIN
        self._minima: deque[int] = deque(maxlen=_PARTS + 1)
        self._baseline: int | None = None
        self._baseline_step = 0

    def start(self, sample: Sample, terms: LedgerTerms) -> None:
        if terms.torch_kept_bytes is not None:
            self._baseline, self._baseline_step = terms.torch_kept_bytes, sample.step

    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        kept = terms.torch_kept_bytes
        if kept is None:
            return None
        # The floor of each block of the window: noise and a step's leftovers only add to what is kept, so
        # the floor follows the memory that really stays; a one-time rise moves one block's floor only.
        if kept < self._block_min:
            self._block_min = kept
        left = self._left - 1
        if left:
            self._left = left
            return None
        self._left = self._block_len
        if self._baseline is None:  # serving began without the term: the baseline is this block's floor
            self._baseline, self._baseline_step = self._block_min, sample.step
        minima = self._minima
        minima.append(self._block_min)
        self._block_min = _NO_MIN
        growth = kept - self._baseline
        if growth < self._min or len(minima) <= _PARTS or not self._rises_through(minima):
            self._episode.settle(minima[-1] <= minima[-2] if len(minima) > 1 else True)
            return None
        if not self._episode.fire():
            return None
        return self._flag(sample, terms, kept, growth)

    def plan(self, batch: Columns) -> Plan:
        np, n, block_len = batch.np, batch.n, self._block_len
        kept = batch.kept
        left, block_min, baseline, baseline_step = self._left, self._block_min, self._baseline, self._baseline_step
        minima = deque(self._minima, maxlen=_PARTS + 1)
        actions = np.full(n, SKIP, dtype=np.int64)  # judged once per block: only a block's last sample acts
        at = 0
        while at < n:
            end = at + left  # one past the sample that completes this block
            block_min = min(block_min, int(kept[at:min(end, n)].min()))
            if end > n:
                left -= n - at
                break
            last = end - 1
            if baseline is None:
                baseline, baseline_step = block_min, int(batch.step[last])
            minima.append(block_min)
            block_min = _NO_MIN
            growth = int(kept[last]) - baseline
            if growth < self._min or len(minima) <= _PARTS or not self._rises_through(minima):
                actions[last] = CLEAR if len(minima) <= 1 or minima[-1] <= minima[-2] else NOT_CLEAR
            else:
                actions[last] = FIRE
            left, at = block_len, end
        episode = episode_plan(np, self._episode, actions)
        if isinstance(episode, int):
            return episode

        def commit() -> None:
            self._left, self._block_min, self._minima = left, block_min, minima
            self._baseline, self._baseline_step = baseline, baseline_step
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
        minima = self._minima
        steps = self._block_len * _PARTS
        rate = (minima[-1] - minima[0]) // steps
        margin = terms.oom_margin_bytes
        steps_left = margin // rate if margin is not None and rate > 0 else None
        severity = CRITICAL if steps_left is not None and steps_left <= self._horizon else WARNING
        # The baseline is the level when serving began, not the start of the rise (which ``explain`` dates).
        words = (f"PyTorch memory that outlives each step grew by {format_bytes(growth)} over its level when "
                 f"serving began (step {format_count(self._baseline_step)}), at {format_bytes(rate)}/step "
                 "over the last "
                 f"{format_count(steps)} steps")
        if steps_left is not None:
            words += f"; at this rate the device is full in about {format_count(max(steps_left, 0))} steps"
        words += ": look for tensors kept across steps (outputs, logprobs or metadata held per request)"
        return make_flag(sample, TORCH_DRIFT, severity, words, {
            "growth_bytes": growth, "steps": steps, "slope_bytes_per_step": rate,
            "baseline_step": self._baseline_step, "baseline_torch_kept_bytes": self._baseline,
            "torch_kept_bytes": kept,
            "oom_margin_bytes": margin, "steps_left": steps_left,
        })
