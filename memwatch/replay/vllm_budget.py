"""vLLM's KV budget, for a replay of a run vLLM sized (``kv_allocated`` says ``budget_rule: vllm``).

vLLM 0.33.0 does not use nano-vllm's ``total × utilization − used − (peak − current)``. Its worker asks
for ``requested = ceil(total × gpu_memory_utilization)`` at startup, profiles, and hands the KV cache
``requested − non-KV`` (the memory profiling consumed plus the transient peak, plus the CUDA-graph
estimate), or exactly ``kv_cache_memory_bytes`` when the user set it (utilization is then ignored);
the planner makes ``budget // bytes per block`` blocks. The replay keeps the recorded non-KV bytes,
moved by what the new settings change of the weights and the profiling reserve, and applies the rule
with the new device size and utilization: at the recorded settings it gives the recorded count.
"""

from __future__ import annotations

import math
from typing import Any

from memwatch.records import Event


def vllm_non_kv(rank: int, data: dict[str, Any], events: list[Event]) -> int | None:
    """``requested − budget`` of a rank vLLM sized (``data``: its ``kv_allocated``), else ``None``.

    The budget is what vLLM's profiling returned: ``kv_cache_memory_bytes``, or, when
    ``num_gpu_blocks_override`` replaced it, ``available_kv_cache_memory_bytes``; a run whose planner was
    handed its memory without profiling recorded none, and its KV bytes stand for it."""
    if data.get("budget_rule") != "vllm":
        return None
    requested = next((int(e.data["requested_bytes"]) for e in events if e.rank == rank
                      and e.kind == "vllm_memory_snapshot" and e.data.get("requested_bytes") is not None), None)
    if requested is None:
        requested = requested_bytes(int(data["total_bytes"]), float(data["gpu_memory_utilization"]))
    budget = (data.get("available_kv_cache_memory_bytes") or data.get("kv_cache_memory_bytes")
              or data.get("kv_cache_bytes"))
    if budget is None:
        budget = int(data["num_blocks"]) * int(data["block_bytes"])
    return requested - int(budget)


def requested_bytes(total: int, utilization: float) -> int:
    """vLLM's ``request_memory``: the share of the device the engine may use."""
    return math.ceil(total * utilization)


def vllm_budget(total: int, utilization: float, non_kv: int, fixed: int | None) -> int:
    """The KV bytes vLLM gives the planner on a device of ``total`` bytes."""
    if fixed is not None:
        return fixed
    return requested_bytes(total, utilization) - non_kv
