"""The flag record the detectors raise, and its public vocabulary of kinds and severities.

A flag is a row of the ``flags`` table: who (run, rank), when (step, time), what (kind), how bad
(severity), one plain sentence for people (message) and the exact numbers in bytes for programs
(data). The kinds and severities below are a public contract: dashboards, alert rules and
``memwatch check`` match on them, so they only ever grow.
"""

from __future__ import annotations

from typing import Any, NamedTuple

INFO = "info"
WARNING = "warning"
CRITICAL = "critical"

SEVERITIES: tuple[str, ...] = (INFO, WARNING, CRITICAL)
"""From least to most severe; ``memwatch check`` fails on ``warning`` or worse."""

NON_TORCH_DRIFT = "non_torch_drift"
FRAGMENTATION = "fragmentation"
ACTIVATION_OVER_RESERVE = "activation_over_reserve"
RESERVE_OVERSTATED = "reserve_overstated"
EXTERNAL_PROCESS = "external_process"
KV_PRESSURE = "kv_pressure"
BLOCK_COUNT_MISMATCH = "block_count_mismatch"
OOM_RISK = "oom_risk"
OOM = "oom"
ALLOC_RETRIES = "alloc_retries"
TORCH_DRIFT = "torch_drift"

FLAG_KINDS: tuple[str, ...] = (
    NON_TORCH_DRIFT,           # memory outside PyTorch growing steadily after serving started
    FRAGMENTATION,             # allocator cache pinned in partly used segments, growing while serving
    ACTIVATION_OVER_RESERVE,   # a step's activation peak above the warmup reserve
    RESERVE_OVERSTATED,        # the warmup reserve far above every serving step's peak
    EXTERNAL_PROCESS,          # a step change in memory outside this process's allocator
    KV_PRESSURE,               # KV cache near full while requests are preempted
    BLOCK_COUNT_MISMATCH,      # ranks sized different KV block counts, or the count misses the formula
    OOM_RISK,                  # little room left for the next forward, or trending to none
    OOM,                       # an out-of-memory error happened
    ALLOC_RETRIES,             # the allocator flushed its cache and retried a failed cudaMalloc
    TORCH_DRIFT,               # PyTorch memory kept across steps (beyond weights and KV) rising while serving
)


class Flag(NamedTuple):
    """One finding about one rank at one step (a row of ``flags``)."""

    run_id: str
    rank: int
    step: int
    ts_ns: int
    kind: str
    severity: str
    message: str
    data: dict[str, Any]


_SEVERITY_ORDER = {severity: position for position, severity in enumerate(SEVERITIES)}


def severity_at_least(severity: str, floor: str) -> bool:
    """Whether ``severity`` is ``floor`` or worse (``severity_at_least(f.severity, WARNING)``)."""
    return _SEVERITY_ORDER[severity] >= _SEVERITY_ORDER[floor]
