"""Thresholds of every detector, with defaults that keep a clean serving run silent.

Byte thresholds are absolute unless a fraction scales them with the rank's budget or activation
reserve (fragmentation, where a fixed size misfires on large cards); step counts are engine steps.
Each detector raises a flag once per episode and re-arms only after its condition has stayed clear,
with margin, for ``rearm_steps`` samples, so a condition that flickers does not flood the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memwatch.errors import UsageError

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class DetectorConfig:
    """Detector thresholds; build one with keyword arguments or :meth:`from_mapping`."""

    rearm_steps: int = 100
    """Clear samples (with margin) needed before a detector may raise its flag again."""

    drift_min_bytes: int = 256 * MiB
    """``non_torch_drift``: growth of non-PyTorch memory since serving started, step changes excluded."""

    torch_drift_min_bytes: int = 256 * MiB
    """``torch_drift``: growth of PyTorch memory kept across steps (beyond weights and KV) since serving
    started, at least this ..."""
    torch_drift_window_steps: int = 200
    """... and still rising through each quarter of this many steps (growth that levelled off is not a leak)."""

    jump_min_bytes: int = 256 * MiB
    """``external_process``: a rise of non-PyTorch memory this large ..."""
    jump_window_steps: int = 4
    """... within this many steps ..."""
    jump_settle_steps: int = 8
    """... that then stops rising for this many steps is a step change, not a slope."""

    fragmentation_min_bytes: int = 256 * MiB
    """``fragmentation``: growth of pinned cache (free splits of used segments) since serving started, at
    least this ..."""
    fragmentation_budget_fraction: float = 0.02
    """... and at least this fraction of the rank's budget (scales with the GPU) ..."""
    fragmentation_reserve_ratio: float = 0.5
    """... and at least this fraction of the activation reserve (what the worst-case forward needs) ..."""
    fragmentation_sustain_steps: int = 20
    """... for this many consecutive samples."""

    alloc_retries_warning_count: int = 3
    """``alloc_retries``: info on the first allocator retry while serving; warning at this many ..."""
    alloc_retries_window_steps: int = 500
    """... within this many steps."""

    activation_tolerance_bytes: int = 64 * MiB
    """``activation_over_reserve``: how far a step's activation peak may exceed the reserve."""

    reserve_judge_steps: int = 500
    """``reserve_overstated``: serving steps with per-step peaks seen before judging the reserve."""
    reserve_overstated_min_bytes: int = 1 * GiB
    """Regainable bytes (reserve minus the largest step's activation) worth reporting ..."""
    reserve_overstated_ratio: float = 0.5
    """... when the largest step's activation is at most this fraction of the reserve."""

    kv_pressure_usage: float = 0.95
    """``kv_pressure``: fraction of KV blocks in use counted as full ..."""
    kv_pressure_window_steps: int = 100
    """... with preemptions within this many steps ..."""
    kv_pressure_min_preemptions: int = 1
    """... at least this many of them."""

    oom_margin_min_bytes: int = 256 * MiB
    """``oom_risk`` (critical): the OOM margin below this."""
    oom_forecast_window_steps: int = 40
    """``oom_risk`` (warning): samples the margin's trend is measured over ..."""
    oom_forecast_min_samples: int = 20
    """... at least this many before a trend is trusted ..."""
    oom_forecast_horizon_steps: int = 2_000
    """... warn when the trend reaches zero within this many steps ..."""
    oom_sustain_steps: int = 5
    """... and the forecast has held for this many consecutive samples."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _FRACTIONS:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                    raise UsageError(f"detector setting {field.name} must be a fraction in (0, 1], got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"detector setting {field.name} must be a positive integer, got {value!r}")

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> DetectorConfig:
        """Defaults overridden by ``settings`` (from a config file or the command line)."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise UsageError(f"unknown detector setting {unknown[0]!r}; known settings: {', '.join(sorted(known))}")
        return cls(**settings)


_FRACTIONS = frozenset({"reserve_overstated_ratio", "kv_pressure_usage", "fragmentation_budget_fraction",
                        "fragmentation_reserve_ratio"})
