"""The data of the one-off events a ``Monitor`` records, built from probe readings apart from its ring bookkeeping."""

from __future__ import annotations

from typing import Any

from .probes.base import UNKNOWN


def known(value: int) -> int | None:
    """A probe reading as JSON keeps it: ``UNKNOWN`` becomes None."""
    return None if value == UNKNOWN else value


def request_key(request_id: Any) -> int | str:
    """Request ids as JSON keeps them: integers stay integers, anything else becomes its string."""
    return request_id if isinstance(request_id, int) and not isinstance(request_id, bool) else str(request_id)


def weights_data(reading: tuple[int, ...], weights_bytes: int | None, load_baseline: int | None) -> dict[str, Any]:
    """``weights_loaded``: the weights are the allocator's growth since ``load`` began, unless given."""
    allocated, peak, reserved, _, _ = reading
    if weights_bytes is None and allocated != UNKNOWN:
        weights_bytes = allocated - (load_baseline or 0)
    return {
        "weights_bytes": weights_bytes, "allocated_bytes": known(allocated),
        "peak_bytes": known(peak), "reserved_bytes": known(reserved),
    }


def kv_data(
    reading: tuple[int, ...],
    num_blocks: int,
    block_bytes: int,
    *,
    total_bytes: int | None,
    used_bytes: int | None,
    peak_bytes: int | None,
    current_bytes: int | None,
    reserved_bytes: int | None,
    gpu_memory_utilization: float | None,
    block_size: int | None,
    kv_cache_memory_bytes: int | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """``kv_allocated``: the engine's own readings where given, the probe's ``reading`` for the rest."""
    current, peak, reserved, used, free = reading
    if reserved_bytes is None and used_bytes is None:
        reserved_bytes = known(reserved)
    if total_bytes is None and used != UNKNOWN:
        total_bytes = used + free
    data = {
        "total_bytes": total_bytes,
        "gpu_memory_utilization": gpu_memory_utilization,
        "used_bytes": used_bytes if used_bytes is not None else known(used),
        "peak_bytes": peak_bytes if peak_bytes is not None else known(peak),
        "current_bytes": current_bytes if current_bytes is not None else known(current),
        "reserved_bytes": reserved_bytes,
        "block_bytes": int(block_bytes),
        "num_blocks": int(num_blocks),
    }
    if block_size is not None:
        data["block_size"] = int(block_size)
    if kv_cache_memory_bytes is not None:
        data["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    data.update(extra)
    return data


def oom_data(reading: tuple[int, ...], requested_bytes: int | None, details: dict[str, Any]) -> dict[str, Any]:
    """``oom``: what was asked for and every reading at the moment it failed."""
    allocated, peak, reserved, used, free = reading
    data = {
        "requested_bytes": requested_bytes, "allocated_bytes": known(allocated),
        "peak_bytes": known(peak), "reserved_bytes": known(reserved),
        "driver_used_bytes": known(used), "driver_free_bytes": known(free),
    }
    data.update(details)
    return data


def arrival_data(request_id: Any, prompt_tokens: int, max_tokens: int | None) -> dict[str, Any]:
    """``request_arrived``; raises TypeError or ValueError when a count is not a number."""
    data: dict[str, Any] = {"request_id": request_key(request_id), "prompt_tokens": int(prompt_tokens)}
    if max_tokens is not None:
        data["max_tokens"] = int(max_tokens)
    return data


def finish_data(request_id: Any, output_tokens: int) -> dict[str, Any]:
    """``request_finished``; raises TypeError or ValueError when the count is not a number."""
    return {"request_id": request_key(request_id), "output_tokens": int(output_tokens)}
