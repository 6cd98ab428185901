"""The warmup's activation reserve against what serving steps really peak at (per-step peaks only).

Warmup measures the activation reserve as ``peak - current`` around one worst-case forward. Two
ways it goes wrong are visible once each serving step reports its own allocator peak
(``Sample.peak_is_step``). A step's activation is its peak above the long-lived memory, less what was
already allocated above it when serving started (CUDA-graph buffers an engine did not declare) or,
when more, what stayed allocated after the step (tensors kept across steps), so that it measures
what warmup measured: the forward's own rise, never a leak.

* ``activation_over_reserve``: a step's activation peak above the reserve by more than
  ``activation_tolerance_bytes``: the warmup batch was smaller than the real worst case, or ran as
  decode. The next such step may not fit. Re-armed after ``rearm_steps`` step peaks within the reserve.
* ``reserve_overstated``: after ``reserve_judge_steps`` serving steps with peaks, the largest of them
  is at most ``reserve_overstated_ratio`` of the reserve and at least ``reserve_overstated_min_bytes``
  below it: the peak was not reset before warmup, and the difference is KV capacity never used.
  Judged once per sizing; it is ``info`` because a light workload looks the same and nothing breaks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memwatch.detectors.base import Detector, Episode, make_flag
from memwatch.detectors.batch import CLEAR, FIRE, NOT_CLEAR, SKIP, Plan, apply_episode, episode_plan
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.wording import format_bytes, format_count
from memwatch.flags import ACTIVATION_OVER_RESERVE, INFO, RESERVE_OVERSTATED, WARNING, Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Sample

if TYPE_CHECKING:
    from memwatch.detectors.batch import Columns


class ActivationOverReserveDetector(Detector):
    """``activation_over_reserve`` for one rank."""

    __slots__ = ("_episode", "_settled", "_tolerance")

    def __init__(self, config: DetectorConfig) -> None:
        self._tolerance = config.activation_tolerance_bytes
        self._episode = Episode(config.rearm_steps)
        self._settled = 0

    def start(self, sample: Sample, terms: LedgerTerms) -> None:
        self._settled = _settled_activation(terms)

    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        step_peak = terms.step_activation_peak_bytes
        reserve = terms.activation_reserve_bytes
        if step_peak is None or reserve is None:
            return None
        # The step's own baseline: what stayed allocated after it, never below the serving start, so that
        # memory kept across steps (a leak, measured by ``torch_drift``) is not read as activation.
        baseline = self._settled
        now = terms.activation_now_bytes
        if now is not None and now > baseline:
            baseline = now
        activation = step_peak - baseline
        over = activation - reserve
        if over <= self._tolerance:
            self._episode.settle(over <= 0)
            return None
        if not self._episode.fire():
            return None
        step_kind = sample.step_kind or "serving"
        return make_flag(
            sample, ACTIVATION_OVER_RESERVE, WARNING,
            f"a {step_kind} step's activation peak of {format_bytes(activation)} exceeded the warmup "
            f"reserve of {format_bytes(reserve)} by {format_bytes(over)}: warmup ran a smaller batch than "
            f"serving (too short, or as decode)",
            {"step_activation_bytes": activation, "step_activation_peak_bytes": step_peak,
             "settled_activation_bytes": baseline, "activation_reserve_bytes": reserve, "over_bytes": over,
             "step_kind": sample.step_kind, "num_tokens": sample.num_tokens, "num_seqs": sample.num_seqs},
        )


    def plan(self, batch: Columns) -> Plan:
        np = batch.np
        # The step's own baseline, as observe() takes it: what stayed allocated after it, never below the start.
        over = batch.step_activation - np.maximum(batch.activation_now, self._settled) - batch.reserve
        actions = np.where(batch.peak_is_step, np.where(over <= self._tolerance, np.where(over <= 0, CLEAR, NOT_CLEAR),
                                                        FIRE), SKIP)
        episode = episode_plan(np, self._episode, actions)
        if isinstance(episode, int):
            return episode
        return lambda: apply_episode(self._episode, episode)


class ReserveOverstatedDetector(Detector):
    """``reserve_overstated`` for one rank; needs the KV block size to count regainable blocks."""

    __slots__ = ("_block_bytes", "_judge_steps", "_largest", "_min_bytes", "_ratio", "_settled", "_steps")

    def __init__(self, config: DetectorConfig, block_bytes: int | None) -> None:
        self._judge_steps = config.reserve_judge_steps
        self._min_bytes = config.reserve_overstated_min_bytes
        self._ratio = config.reserve_overstated_ratio
        self._block_bytes = block_bytes
        self._steps = 0
        self._largest = 0
        self._settled = 0

    def start(self, sample: Sample, terms: LedgerTerms) -> None:
        self._settled = _settled_activation(terms)

    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        step_peak = terms.step_activation_peak_bytes
        if step_peak is None or self._steps >= self._judge_steps:
            return None
        activation = step_peak - self._settled
        self._steps += 1
        if activation > self._largest:
            self._largest = activation
        if self._steps < self._judge_steps:
            return None
        reserve = terms.activation_reserve_bytes
        if reserve is None:
            return None
        regainable = reserve - self._largest
        if regainable < self._min_bytes or self._largest > reserve * self._ratio:
            return None
        block_bytes = self._block_bytes
        blocks = regainable // block_bytes if block_bytes else None
        blocks_words = "" if blocks is None else f" ({format_count(blocks)} KV blocks)"
        return make_flag(
            sample, RESERVE_OVERSTATED, INFO,
            f"the warmup reserved {format_bytes(reserve)} for activations but no serving step in "
            f"{format_count(self._steps)} needed more than {format_bytes(self._largest)}: "
            f"{format_bytes(regainable)}{blocks_words} of KV capacity is unused (was the peak reset "
            f"before warmup?)",
            {"activation_reserve_bytes": reserve, "largest_step_activation_bytes": self._largest,
             "regainable_bytes": regainable, "regainable_blocks": blocks, "block_bytes": block_bytes,
             "settled_activation_bytes": self._settled, "steps": self._steps},
        )


    def plan(self, batch: Columns) -> Plan:
        if self._steps >= self._judge_steps:
            return _nothing
        activations = batch.step_activation[batch.peak_is_step] - self._settled
        if self._steps + len(activations) >= self._judge_steps:  # the judgement falls in this batch, there
            return int(batch.peak_is_step.nonzero()[0][self._judge_steps - self._steps - 1])
        if not len(activations):
            return _nothing

        def commit() -> None:
            self._steps += len(activations)
            self._largest = max(self._largest, int(activations.max()))

        return commit


def _nothing() -> None:
    """A plan with nothing to change."""


def _settled_activation(terms: LedgerTerms) -> int:
    """Memory allocated above the long-lived terms when serving started (never negative)."""
    settled = terms.activation_now_bytes
    return settled if settled is not None and settled > 0 else 0
