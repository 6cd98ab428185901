"""Out of memory: the risk before it (``oom_risk``) and the fact after it (``oom``).

The ledger's ``oom_margin_bytes`` is what the driver would still have after the next worst-case
forward, counting wholly free cached segments as free (the allocator releases them and retries
before it fails). That holds for PyTorch's own requests only: a ``cudaMalloc`` outside PyTorch
(NCCL, cuBLAS, an extension) gets the driver's free memory and nothing of the cache. So when memory
outside PyTorch is what grows (over the trend window ``non_torch_bytes`` rose by at least half the
margin's fall) the rule judges the *driver margin* instead, where it is the lower:
``min(free, oom_margin_bytes)``, the driver's free memory less what the next forward needs beyond
the cache. ``oom_risk`` is raised in two ways:

* critical: the margin judged is under ``oom_margin_min_bytes`` (re-armed at twice that);
* warning: a forecast. Over the last ``oom_forecast_window_steps`` samples (at least
  ``oom_forecast_min_samples``) the margin fell, each half of the window carrying at least a
  quarter of the fall; at that rate it
  reaches zero within ``oom_forecast_horizon_steps``; and this has held for ``oom_sustain_steps``
  consecutive samples. The flag carries the lead time in steps and, from the samples' clock, in
  nanoseconds. Re-armed once the forecast is beyond twice the horizon. The lead time is the margin
  judged divided by the fall of ``oom_margin_bytes``; the flag says which margin it judged.

The trend is the margin now against the margin a window ago: two subtractions per sample, which a
gradual leak cannot hide from. Asking both halves to share the fall tells a trend from a step
(one process starting, one larger batch caching more), which moves the margin once and is judged by
the level rule; the sustain keeps a single noisy reading from raising anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memwatch.detectors.base import Detector, Episode, make_flag
from memwatch.detectors.batch import (
    CLEAR,
    FIRE,
    NOT_CLEAR,
    SKIP,
    Plan,
    active_after,
    apply_episode,
    consecutive,
    episode_plan,
)
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.wording import format_bytes, format_count, format_duration_ns
from memwatch.flags import CRITICAL, OOM, OOM_RISK, WARNING, Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Event, Sample

if TYPE_CHECKING:
    from memwatch.detectors.batch import Columns

FREE_AND_RECLAIMABLE = "free_and_reclaimable"
"""``margin`` of a flag judged on ``oom_margin_bytes``: free memory plus wholly free cached segments."""
DRIVER_FREE = "driver_free"
"""``margin`` of a flag judged on the driver's free memory alone (memory outside PyTorch is growing)."""


class OomRiskDetector(Detector):
    """``oom_risk`` for one rank."""

    __slots__ = ("_filled", "_forecast", "_horizon", "_index", "_level", "_margins", "_min_margin",
                 "_min_samples", "_non_torch", "_run", "_start_kept", "_start_margin", "_steps", "_sustain", "_times")

    def __init__(self, config: DetectorConfig) -> None:
        window = config.oom_forecast_window_steps
        self._min_margin = config.oom_margin_min_bytes
        self._min_samples = min(config.oom_forecast_min_samples, window)
        self._horizon = config.oom_forecast_horizon_steps
        self._sustain = config.oom_sustain_steps
        self._level = Episode(config.rearm_steps)
        self._forecast = Episode(config.rearm_steps)
        self._margins = [0] * window
        self._steps = [0] * window
        self._times = [0] * window
        self._non_torch: list[int | None] = [None] * window
        self._index = 0
        self._filled = 0
        self._run = 0
        self._start_kept: int | None = None
        self._start_margin: int | None = None

    def start(self, sample: Sample, terms: LedgerTerms) -> None:
        # Where serving began: a forecast names memory kept across steps as its cause when that term grew by at
        # least half of the margin's fall since then.
        self._start_kept, self._start_margin = terms.torch_kept_bytes, terms.oom_margin_bytes

    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        margin = terms.oom_margin_bytes
        if margin is None:
            return None
        free = sample.driver_free_bytes
        driver_margin = margin if free is None or free >= margin else free
        non_torch = terms.non_torch_bytes
        margins = self._margins
        window = len(margins)
        index = self._index
        if self._filled < window:
            self._filled += 1
            oldest = 0
            middle = self._filled // 2
        else:
            oldest = index
            middle = index + window // 2
            if middle >= window:
                middle -= window
        old_margin, old_step, old_ts = margins[oldest], self._steps[oldest], self._times[oldest]
        old_non_torch = self._non_torch[oldest]
        middle_margin = margins[middle]
        margins[index], self._steps[index], self._times[index] = margin, sample.step, sample.ts_ns
        self._non_torch[index] = non_torch
        self._index = index + 1 if index + 1 < window else 0

        drop = old_margin - margin
        # Memory outside PyTorch carries the fall and the cache is what keeps the margin above free: the cache
        # is not released for a cudaMalloc outside PyTorch, so only free counts.
        outside = (driver_margin < margin and drop > 0 and non_torch is not None and old_non_torch is not None
                   and 2 * (non_torch - old_non_torch) >= drop)
        judged = driver_margin if outside else margin
        if judged < self._min_margin:
            self._run = 0
            return self._level_flag(sample, terms, judged, outside) if self._level.fire() else None
        self._level.settle(judged >= 2 * self._min_margin)

        steps = sample.step - old_step
        share = drop >> 2
        if (self._filled < self._min_samples or steps <= 0 or drop <= 0
                or old_margin - middle_margin < share or middle_margin - margin < share):
            self._run = 0
            self._forecast.settle(True)
            return None
        steps_to_zero = judged * steps // drop
        if steps_to_zero > self._horizon:
            self._run = 0
            self._forecast.settle(steps_to_zero > 2 * self._horizon)
            return None
        self._run += 1
        if self._run < self._sustain or self._level.active:
            self._forecast.settle(False)
            return None
        if not self._forecast.fire():
            return None
        # The rate from the onset: a window that reaches back before the fall began would read it low.
        onset = self._onset(index, old_margin)
        if onset >= 0:
            old_margin, old_step, old_ts = margins[onset], self._steps[onset], self._times[onset]
            drop, steps = old_margin - margin, max(sample.step - self._steps[onset], 1)
            steps_to_zero = judged * steps // drop if drop > 0 else steps_to_zero
        elapsed_ns = sample.ts_ns - old_ts
        ns_to_zero = judged * elapsed_ns // drop if elapsed_ns > 0 and drop > 0 else None
        slope = drop // steps
        when = "" if ns_to_zero is None else f" ({format_duration_ns(ns_to_zero)})"
        kept = terms.torch_kept_bytes
        cause = None
        if outside:
            cause = "non_torch_bytes"
        elif (kept is not None and self._start_kept is not None and self._start_margin is not None
              and 2 * (kept - self._start_kept) >= self._start_margin - margin > 0):
            cause = "torch_kept_bytes"
        if outside:
            words = (f"memory outside PyTorch is growing, and PyTorch's cache is not released for it: the driver's "
                     f"free memory ({format_bytes(judged)} after the next worst-case forward) is falling by "
                     f"{format_bytes(slope)}/step and will run out in about {format_count(steps_to_zero)} steps{when}")
        else:
            words = (f"the OOM margin of {format_bytes(judged)} is falling by {format_bytes(slope)}/step: the next "
                     f"worst-case forward will not fit in about {format_count(steps_to_zero)} steps{when}")
        data = {**_margin_data(sample, terms, judged, outside), "slope_bytes_per_step": slope,
                "steps_to_zero": steps_to_zero, "ns_to_zero": ns_to_zero, "trend_steps": steps}
        if cause == "torch_kept_bytes":
            words += "; what grows is PyTorch memory kept across steps: a leak inside PyTorch"
            data["cause"] = cause
        return make_flag(sample, OOM_RISK, WARNING, words, data)

    def _onset(self, newest: int, start_margin: int) -> int:
        """The last slot before ``newest`` whose margin had not yet fallen below the window's first, ``-1``
        when none did (on the flagging path only: a scan of the window)."""
        margins, window, filled = self._margins, len(self._margins), self._filled
        onset = -1
        position = newest + 1 if filled == window else 0
        for _ in range(filled - 1):
            if position >= window:
                position = 0
            if margins[position] >= start_margin:
                onset = position
            position += 1
        return onset

    def plan(self, batch: Columns) -> Plan:
        window = len(self._margins)
        if self._filled < window or any(value is None for value in self._non_torch):
            return 0  # the window fills sample by sample
        np, n, index = batch.np, batch.n, self._index
        order = [(index + k) % window for k in range(window)]  # oldest first

        def history(values: list[Any], new: Any) -> Any:
            return np.concatenate((np.array([values[k] for k in order], dtype=np.int64), new))

        margins, steps = history(self._margins, batch.margin), history(self._steps, batch.step)
        times, non_torch = history(self._times, batch.ts), history(self._non_torch, batch.non_torch)
        margin, free, nt = batch.margin, batch.driver_free, batch.non_torch
        old_margin, middle_margin = margins[:n], margins[window // 2: window // 2 + n]
        driver_margin = np.where(free >= margin, margin, free)
        drop = old_margin - margin
        outside = (driver_margin < margin) & (drop > 0) & (2 * (nt - non_torch[:n]) >= drop)
        judged = np.where(outside, driver_margin, margin)
        low = judged < self._min_margin
        level_actions = np.where(low, FIRE, np.where(judged >= 2 * self._min_margin, CLEAR, NOT_CLEAR))
        level = episode_plan(np, self._level, level_actions)
        if isinstance(level, int):
            return level  # the forecast's actions before it hold whatever the level does there
        trend_steps = batch.step - steps[:n]
        share = drop >> 2
        no_trend = ((trend_steps <= 0) | (drop <= 0) | (old_margin - middle_margin < share)
                    | (middle_margin - margin < share))
        to_zero = judged * trend_steps // np.where(drop > 0, drop, 1)
        beyond = ~no_trend & (to_zero > self._horizon)
        rising = ~low & ~no_trend & ~beyond
        runs = consecutive(np, rising, self._run)
        level_active = active_after(np, self._level, level, n)
        actions = np.where(low, SKIP, np.where(no_trend, CLEAR, np.where(
            beyond, np.where(to_zero > 2 * self._horizon, CLEAR, NOT_CLEAR),
            np.where((runs < self._sustain) | level_active, NOT_CLEAR, FIRE))))
        forecast = episode_plan(np, self._forecast, actions)
        if isinstance(forecast, int):
            return forecast

        def commit() -> None:
            for k in range(window):
                slot = (index + n + k) % window
                self._margins[slot], self._steps[slot] = int(margins[n + k]), int(steps[n + k])
                self._times[slot], self._non_torch[slot] = int(times[n + k]), int(non_torch[n + k])
            self._index = (index + n) % window
            self._run = int(runs[-1])
            apply_episode(self._level, level)
            apply_episode(self._forecast, forecast)

        return commit

    def _level_flag(self, sample: Sample, terms: LedgerTerms, margin: int, outside: bool) -> Flag:
        if outside:
            words = (f"memory outside PyTorch is growing, and PyTorch's cache is not released for it: only "
                     f"{format_bytes(max(margin, 0))} of the driver's free memory would be left after the next "
                     f"worst-case forward (threshold {format_bytes(self._min_margin)}): out of memory is close")
        elif margin < 0:
            words = (f"the next worst-case forward needs {format_bytes(-margin)} more than the GPU has "
                     f"left: it will run out of memory")
        else:
            words = (f"only {format_bytes(margin)} would be left after the next worst-case forward "
                     f"(threshold {format_bytes(self._min_margin)}): out of memory is close")
        return make_flag(sample, OOM_RISK, CRITICAL, words,
                         {**_margin_data(sample, terms, margin, outside), "threshold_bytes": self._min_margin})


def _margin_data(sample: Sample, terms: LedgerTerms, judged: int, outside: bool) -> dict[str, Any]:
    return {"oom_margin_bytes": terms.oom_margin_bytes, "judged_margin_bytes": judged,
            "margin": DRIVER_FREE if outside else FREE_AND_RECLAIMABLE,
            "driver_free_bytes": sample.driver_free_bytes, "non_torch_bytes": terms.non_torch_bytes,
            "cache_slack_bytes": terms.cache_slack_bytes, "reclaimable_cache_bytes": terms.reclaimable_cache_bytes,
            "pinned_cache_bytes": terms.pinned_cache_bytes,
            "activation_reserve_bytes": terms.activation_reserve_bytes}


def oom_flag(event: Event, terms: LedgerTerms | None) -> Flag:
    """``oom`` (critical) for an ``oom`` event, with what the ledger last knew about the rank."""
    data = dict(event.data) if isinstance(event.data, dict) else {}
    requested, free = data.get("requested_bytes"), data.get("driver_free_bytes")
    sentence = "out of memory"
    if isinstance(requested, int):
        sentence += f": a request for {format_bytes(requested)} failed"
        if isinstance(free, int):
            sentence += f" with {format_bytes(free)} free on the device"
    held = [f"{name} {format_bytes(data[key])}" for name, key in
            (("allocated", "allocated_bytes"), ("reserved", "reserved_bytes")) if isinstance(data.get(key), int)]
    if held:
        sentence += f" ({', '.join(held)})"
    if terms is not None:
        data.setdefault("oom_margin_bytes", terms.oom_margin_bytes)
        data.setdefault("non_torch_bytes", terms.non_torch_bytes)
        data.setdefault("cache_slack_bytes", terms.cache_slack_bytes)
    return make_flag(event, OOM, CRITICAL, sentence, data)
