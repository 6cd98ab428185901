"""Per-rank summaries of a run, kept up to date record by record: what ``check`` and ``explain`` start from.

The same :class:`SummaryTracker` runs in a replay and live in the sidecar, next to the detectors; the
sidecar stores its state as it goes (``rank_summaries``), so that ``check`` and ``explain`` read a
few rows instead of replaying millions of samples. Everything here is bounded: a fixed number of
values per rank, whatever the run's length. JSON round-trips (:meth:`RankSummary.to_json`) keep
the exact integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memwatch.detectors.detector_set import STARTUP_PHASES
from memwatch.ledger import LedgerTerms, Sizing
from memwatch.records import Sample


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
        if terms.budget_bytes is None or sample.phase in STARTUP_PHASES:
            return
        if terms.step_activation_peak_bytes is not None:
            self.largest_activation_bytes = max(self.largest_activation_bytes, terms.step_activation_peak_bytes)
        point = None
        if self.first_serving is None:
            point = self.first_serving = serving_point(sample, terms)
        best = self.tightest_serving
        if margin is not None and (best is None or best.oom_margin_bytes is None or margin < best.oom_margin_bytes):
            self.tightest_serving = point or serving_point(sample, terms)

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


def serving_point(sample: Sample, terms: LedgerTerms) -> ServingPoint:
    return ServingPoint(sample.step, sample.ts_ns, terms.non_torch_bytes, terms.cache_slack_bytes,
                        sample.allocated_bytes, sample.driver_free_bytes, terms.oom_margin_bytes,
                        terms.activation_reserve_bytes, terms.headroom_bytes, terms.reclaimable_cache_bytes)
