"""What a simulated run reports: per rank, the startup ledger and the serving outcome; per run, the totals."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PhaseSummary:
    name: str
    wall_ns: int
    virtual_ns: int


@dataclass(frozen=True)
class RankSummary:
    """One rank: the terms of its KV sizing (the KV-sizing invariant) and what serving did to it.

    At sizing, ``non_torch_bytes + cache_slack_bytes + current + activation_reserve_bytes + kv_budget``
    equals ``total × utilization``, where ``non_torch_bytes = used − reserved`` (context, NCCL, other
    processes), ``cache_slack_bytes = reserved − current`` and ``activation_reserve_bytes = peak − current``.
    """

    rank: int
    run_id: str
    status: str
    """``ok``, ``oom`` (this rank ran out of memory), ``crashed`` (this rank's process died outside
    PyTorch's allocator) or ``error`` (the run died)."""
    phases: tuple[PhaseSummary, ...]
    weights_bytes: int | None
    activation_reserve_bytes: int | None
    non_torch_bytes: int | None
    cache_slack_bytes: int | None
    num_blocks: int | None
    block_bytes: int | None
    kv_tokens: int | None
    """Tokens the KV cache holds: ``num_blocks × block_size``."""
    max_resident_requests: int
    preemptions: int
    steps: int
    oom: bool
    ring_path: str | None
    kv_sizing: dict[str, Any] | None = None
    """The readings the formula used: total, used, peak, current, utilization, block bytes, blocks."""
    oom_details: dict[str, Any] | None = None
    crash_details: dict[str, Any] | None = None
    """``phase``, ``step`` (the last step this rank recorded) and ``error`` of a crash."""

    @property
    def kv_bytes(self) -> int | None:
        return None if self.num_blocks is None or self.block_bytes is None else self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class SimulationResult:
    run_id: str
    scenario: str
    model: str
    status: str
    """``ok``, ``oom`` when a rank ran out of memory, ``crashed`` when a rank's process died outside
    PyTorch's allocator, ``error`` when the engine died of something else."""
    ranks: tuple[RankSummary, ...]
    requests: int
    finished_requests: int
    steps: int
    preemptions: int
    max_resident_requests: int
    """The most requests holding KV blocks at once (running, or mid-way through a chunked prefill)."""
    max_kv_blocks_used: int
    virtual_duration_ns: int
    wall_duration_ns: int
    error: str | None = None
    faults: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for rank, summary in zip(data["ranks"], self.ranks, strict=True):
            rank["kv_bytes"] = summary.kv_bytes
        return data
