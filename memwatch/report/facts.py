"""The numbers a run is summarised by, per rank: what the report's table shows and ``diff`` compares.

All of them come from the peak-keeping series and the events already read for the figure (no
second pass over the samples), except the drift slope, which ``diff`` asks SQL for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memwatch.kv_sizing import kv_bytes_of, sizing_of
from memwatch.report.run_data import RankData, RunData
from memwatch.store.run_figures import non_torch_at_sizing


def _max(values: list[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _min(values: list[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


@dataclass(frozen=True)
class RankFacts:
    rank: int
    status: str | None
    samples: int
    last_step: int | None
    weights_bytes: int | None
    torch_other_bytes: int | None
    activation_reserve_bytes: int | None
    """Warmup's peak − current at sizing."""
    non_pytorch_bytes: int | None
    """Non-PyTorch at sizing, defined once in :func:`memwatch.store.run_figures.non_torch_at_sizing`:
    ``used − reserved`` less KV mapped outside the allocator (the engine's ``used − current`` also holds the cache
    slack)."""
    num_blocks: int | None
    block_bytes: int | None
    kv_bytes: int | None
    budget_bytes: int | None
    peak_used_bytes: int | None
    min_free_bytes: int | None
    serving_peak_bytes: int | None
    """The allocator's largest peak once serving started (the engine resets it every step while serving)."""
    preemptions: int
    flags: dict[str, int]
    oom_requested_bytes: int | None
    oom_step: int | None
    cuda_graphs_outside_budget_bytes: int | None = None
    """CUDA graphs captured after sizing that the engine's budget leaves out: why driver-used may stand above
    the budget line with no leak (the number ``check`` gives, :mod:`memwatch.report.graphs`)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rank_facts(data: RankData) -> RankFacts:
    sizing = data.sizing or {}
    current, peak = sizing.get("current_bytes"), sizing.get("peak_bytes")
    blocks, block_bytes = sizing.get("num_blocks"), sizing.get("block_bytes")
    weights = data.weights_bytes if data.weights_bytes is not None else current
    utilization, total = sizing.get("gpu_memory_utilization"), sizing.get("total_bytes")
    series = data.series
    flags: dict[str, int] = {}
    for flag in data.flags:
        flags[flag.kind] = flags.get(flag.kind, 0) + 1
    oom = data.ooms[0] if data.ooms else None
    requested = None if oom is None else oom.data.get("requested_bytes")
    return RankFacts(
        rank=data.rank, status=data.status, samples=series.samples,
        last_step=series.last_step[-1] if series.last_step else None,
        weights_bytes=weights,
        torch_other_bytes=None if current is None or weights is None else max(current - weights, 0),
        activation_reserve_bytes=None if peak is None or current is None else peak - current,
        non_pytorch_bytes=non_torch_at_sizing(sizing_of(sizing)) if sizing else None,
        num_blocks=blocks, block_bytes=block_bytes,
        kv_bytes=kv_bytes_of(sizing),
        budget_bytes=None if total is None or utilization is None else int(total * utilization),
        peak_used_bytes=_max(series.used_max), min_free_bytes=_min(series.free_min),
        serving_peak_bytes=_serving_peak(data),
        preemptions=sum(int(e.data.get("count", 1) or 1) for e in data.preemptions),
        flags=flags, oom_requested_bytes=requested if isinstance(requested, int) else None,
        oom_step=None if oom is None else oom.step,
        cuda_graphs_outside_budget_bytes=data.cuda_graphs_outside_budget_bytes,
    )


def _serving_peak(data: RankData) -> int | None:
    """Read from the stored samples, never from the drawn series: a downsampled bucket spans the serve phase's
    start, and the peak inside it would be dropped (or warm-up's taken) at 50 buckets and not at 1,500."""
    return data.serving_peak_bytes


def run_facts(data: RunData) -> list[RankFacts]:
    return [rank_facts(rank) for rank in data.ranks]
