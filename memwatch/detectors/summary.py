"""Per-rank summaries of a run, kept up to date record by record: what ``check`` and ``explain`` start from.

The same :class:`SummaryTracker` runs in a replay and live in the sidecar, next to the detectors; the
sidecar stores its state as it goes (``rank_summaries``), so that ``check`` and ``explain`` read a
few rows instead of replaying millions of samples. Everything here is bounded: a fixed number of
values per rank, whatever the run's length. JSON round-trips (:meth:`RankSummary.to_json`) keep
the exact integers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memwatch.detectors.detector_set import STARTUP_PHASES
from memwatch.ledger import LedgerTerms, Sizing
from memwatch.records import Sample

if TYPE_CHECKING:
    from memwatch.detectors.batch import Columns


@dataclass(frozen=True)
class Tightest:
    """The sample where one ledger term was smallest."""

    step: int
    ts_ns: int
    value_bytes: int
    terms: LedgerTerms


@dataclass(frozen=True)
class ServingPoint:
    """A sample after KV sizing outside the start-up phases, with the terms ``explain`` follows."""

    step: int
    ts_ns: int
    non_torch_bytes: int | None
    cache_slack_bytes: int | None
    allocated_bytes: int | None
    driver_free_bytes: int | None
    oom_margin_bytes: int | None
    activation_reserve_bytes: int | None
    headroom_bytes: int | None
    reclaimable_cache_bytes: int | None = None


MINUTE_NS = 60_000_000_000
SEARCHED_TERMS: tuple[str, ...] = ("non_torch_bytes", "cache_slack_bytes", "allocated_bytes")
"""The terms ``explain`` searches a rank's serving points by."""


@dataclass
class Minute:
    """One minute of one rank: the range of each searched term over its serving points, and the largest
    step rise (``peak - allocated`` of a step's own peak) after sizing. A store keeps one row per minute,
    so that a search of a long run reads the few minutes that can hold the answer."""

    low: list[int | None] = field(default_factory=lambda: [None] * len(SEARCHED_TERMS))
    high: list[int | None] = field(default_factory=lambda: [None] * len(SEARCHED_TERMS))
    max_step_rise_bytes: int | None = None

    def add_rise(self, rise: int) -> None:
        if self.max_step_rise_bytes is None or rise > self.max_step_rise_bytes:
            self.max_step_rise_bytes = rise

    def add_point(self, values: tuple[int | None, ...]) -> None:
        low, high = self.low, self.high
        for i, value in enumerate(values):
            if value is None:
                continue
            if low[i] is None or value < low[i]:  # type: ignore[operator]
                low[i] = value
            if high[i] is None or value > high[i]:  # type: ignore[operator]
                high[i] = value


@dataclass
class RankSummary:
    """One rank's run so far: samples, last terms, tightest moments, sizing, and what ``explain`` needs."""

    rank: int
    samples: int = 0
    last_step: int | None = None
    last_ts_ns: int | None = None
    last_terms: LedgerTerms | None = None
    min_headroom: Tightest | None = None
    min_oom_margin: Tightest | None = None
    sizing: Sizing | None = None
    first_serving: ServingPoint | None = None
    """The first point ``explain`` measures growth from."""
    tightest_serving: ServingPoint | None = None
    """The serving point with the smallest OOM margin."""
    largest_activation_bytes: int = 0
    """The largest step activation peak among serving points."""
    first_running: Sample | None = None
    """The first sample outside the start-up phases, sized or not (where raw readings are measured from)."""
    max_peak_bytes: int | None = None
    max_reserved_bytes: int | None = None
    max_driver_used_bytes: int | None = None
    minutes: dict[int, Minute] = field(default_factory=dict)
    """Minutes touched since the owner last stored and cleared them (not part of :meth:`to_json`)."""

    def observe(self, sample: Sample, terms: LedgerTerms) -> None:
        """Take in one sample of this rank and its ledger terms."""
        self.samples += 1
        self.last_step = sample.step
        self.last_ts_ns = sample.ts_ns
        self.last_terms = terms
        if sample.peak_bytes is not None and (self.max_peak_bytes is None or sample.peak_bytes > self.max_peak_bytes):
            self.max_peak_bytes = sample.peak_bytes
        reserved, used = sample.reserved_bytes, sample.driver_used_bytes
        if reserved is not None and (self.max_reserved_bytes is None or reserved > self.max_reserved_bytes):
            self.max_reserved_bytes = reserved
        if used is not None and (self.max_driver_used_bytes is None or used > self.max_driver_used_bytes):
            self.max_driver_used_bytes = used
        if self.first_running is None and sample.phase not in STARTUP_PHASES:
            self.first_running = sample
        headroom, margin = terms.headroom_bytes, terms.oom_margin_bytes
        if headroom is not None and (self.min_headroom is None or headroom < self.min_headroom.value_bytes):
            self.min_headroom = Tightest(sample.step, sample.ts_ns, headroom, terms)
        if margin is not None and (self.min_oom_margin is None or margin < self.min_oom_margin.value_bytes):
            self.min_oom_margin = Tightest(sample.step, sample.ts_ns, margin, terms)
        minute = None
        if sample.peak_is_step and terms.activation_reserve_bytes is not None and sample.peak_bytes is not None \
                and sample.allocated_bytes is not None:
            minute = self._minute(sample.ts_ns)
            minute.add_rise(sample.peak_bytes - sample.allocated_bytes)
        if terms.budget_bytes is None or sample.phase in STARTUP_PHASES:
            return
        (minute or self._minute(sample.ts_ns)).add_point((terms.non_torch_bytes, terms.cache_slack_bytes,
                                                          sample.allocated_bytes))
        if terms.step_activation_peak_bytes is not None:
            self.largest_activation_bytes = max(self.largest_activation_bytes, terms.step_activation_peak_bytes)
        point = None
        if self.first_serving is None:
            point = self.first_serving = serving_point(sample, terms)
        best = self.tightest_serving
        if margin is not None and (best is None or best.oom_margin_bytes is None or margin < best.oom_margin_bytes):
            self.tightest_serving = point or serving_point(sample, terms)

    def observe_batch(self, batch: Columns, sample_at: Callable[[int], tuple[Sample, LedgerTerms]],
                      last_terms: LedgerTerms) -> None:
        """What :meth:`observe` does over a batch of serving samples after sizing (every reading present):
        ``sample_at(i)`` gives the batch's i-th sample and its terms, asked only where a tightest moment
        or a first point falls; ``last_terms`` are the last sample's."""
        np, n = batch.np, batch.n
        self.samples += n
        self.last_step, self.last_ts_ns, self.last_terms = int(batch.step[-1]), int(batch.ts[-1]), last_terms
        self.max_peak_bytes = _larger(self.max_peak_bytes, int(batch.peak.max()))
        self.max_reserved_bytes = _larger(self.max_reserved_bytes, int(batch.reserved.max()))
        self.max_driver_used_bytes = _larger(self.max_driver_used_bytes, int(batch.used.max()))
        if self.first_running is None:
            self.first_running = sample_at(0)[0]
        lowest = int(batch.headroom.argmin())
        if self.min_headroom is None or batch.headroom[lowest] < self.min_headroom.value_bytes:
            sample, terms = sample_at(lowest)
            self.min_headroom = Tightest(sample.step, sample.ts_ns, int(batch.headroom[lowest]), terms)
        tightest = int(batch.margin.argmin())
        margin = int(batch.margin[tightest])
        if self.min_oom_margin is None or margin < self.min_oom_margin.value_bytes:
            sample, terms = sample_at(tightest)
            self.min_oom_margin = Tightest(sample.step, sample.ts_ns, margin, terms)
        minutes = batch.ts // MINUTE_NS
        step_peaks = batch.peak_is_step
        rises = batch.peak - batch.allocated
        values = (batch.non_torch, batch.slack, batch.allocated)
        first, last = int(minutes.min()), int(minutes.max())
        for key in ([first] if first == last else np.unique(minutes).tolist()):  # a batch mostly sits in one minute
            here = minutes == key
            minute = self._minute(key * MINUTE_NS)
            peaks_here = here & step_peaks
            if peaks_here.any():
                minute.add_rise(int(rises[peaks_here].max()))
            minute.add_point(tuple(int(column[here].min()) for column in values))
            minute.add_point(tuple(int(column[here].max()) for column in values))
        if step_peaks.any():
            self.largest_activation_bytes = max(self.largest_activation_bytes,
                                                int(batch.step_activation[step_peaks].max()))
        if self.first_serving is None:
            self.first_serving = serving_point(*sample_at(0))
        best = self.tightest_serving
        if best is None or best.oom_margin_bytes is None or margin < best.oom_margin_bytes:
            self.tightest_serving = serving_point(*sample_at(tightest))

    def _minute(self, ts_ns: int) -> Minute:
        key = ts_ns // MINUTE_NS
        minute = self.minutes.get(key)
        if minute is None:
            minute = self.minutes[key] = Minute()
        return minute

    def to_json(self) -> dict[str, Any]:
        def tight(value: Tightest | None) -> list[Any] | None:
            return None if value is None else [value.step, value.ts_ns, value.value_bytes, list(value.terms)]

        def point(value: ServingPoint | None) -> list[Any] | None:
            return None if value is None else list(value.__dict__.values())

        return {
            "rank": self.rank, "samples": self.samples, "last_step": self.last_step, "last_ts_ns": self.last_ts_ns,
            "last_terms": None if self.last_terms is None else list(self.last_terms),
            "min_headroom": tight(self.min_headroom), "min_oom_margin": tight(self.min_oom_margin),
            "sizing": None if self.sizing is None else list(self.sizing),
            "first_serving": point(self.first_serving), "tightest_serving": point(self.tightest_serving),
            "first_running": None if self.first_running is None else list(self.first_running),
            "largest_activation_bytes": self.largest_activation_bytes, "max_peak_bytes": self.max_peak_bytes,
            "max_reserved_bytes": self.max_reserved_bytes, "max_driver_used_bytes": self.max_driver_used_bytes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankSummary:
        def tight(value: list[Any] | None) -> Tightest | None:
            return None if value is None else Tightest(value[0], value[1], value[2], LedgerTerms(*value[3]))

        def point(value: list[Any] | None) -> ServingPoint | None:
            return None if value is None else ServingPoint(*value)

        return cls(
            rank=data["rank"], samples=data["samples"], last_step=data["last_step"], last_ts_ns=data["last_ts_ns"],
            last_terms=None if data["last_terms"] is None else LedgerTerms(*data["last_terms"]),
            min_headroom=tight(data["min_headroom"]), min_oom_margin=tight(data["min_oom_margin"]),
            sizing=None if data["sizing"] is None else Sizing(*data["sizing"]),
            first_serving=point(data["first_serving"]), tightest_serving=point(data["tightest_serving"]),
            first_running=None if data.get("first_running") is None else Sample(*data["first_running"]),
            largest_activation_bytes=data["largest_activation_bytes"], max_peak_bytes=data["max_peak_bytes"],
            max_reserved_bytes=data["max_reserved_bytes"], max_driver_used_bytes=data["max_driver_used_bytes"],
        )


def _larger(current: int | None, value: int) -> int:
    return value if current is None or value > current else current


def serving_point(sample: Sample, terms: LedgerTerms) -> ServingPoint:
    return ServingPoint(sample.step, sample.ts_ns, terms.non_torch_bytes, terms.cache_slack_bytes,
                        sample.allocated_bytes, sample.driver_free_bytes, terms.oom_margin_bytes,
                        terms.activation_reserve_bytes, terms.headroom_bytes, terms.reclaimable_cache_bytes)
