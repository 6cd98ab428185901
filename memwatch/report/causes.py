"""Why a rank ran out of memory: each cause the recorded facts support, ranked by the bytes behind it.

``explain`` names at most these causes, each only from a fact that was recorded: another process's
bytes (an ``external_process`` flag), the allocator's fragmentation (free cache split in pieces too
small for the failing request, or a ``fragmentation`` flag), a leak outside or inside PyTorch (a
ledger term that grew steadily), and an under-measured activation (a failing request larger than the
reserve warmup measured). The cause with the most bytes behind it is said first; a cache that merely
grew (no sign it is split) is reusable by PyTorch, so it is said last, as a contributor.

When a request failed although the device had more free than it asked for, the allocator's rule
for new segments is what explains it, so that is said too (:func:`new_segment_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memwatch.detectors.wording import format_bytes, format_count, format_duration_ns
from memwatch.flags import EXTERNAL_PROCESS, FRAGMENTATION, Flag
from memwatch.report.growth import OutsideSplit, TermGrowth

MiB = 1 << 20
_SMALL_REQUEST = 1 * MiB
_SMALL_SEGMENT = 2 * MiB
_LARGE_BUFFER = 20 * MiB
_MIN_LARGE_ALLOC = 10 * MiB
_LARGE_ROUNDING = 2 * MiB
_ROUNDING = 512
FRAGMENTED_MIN_BYTES = 64 * MiB
"""Free cache split this small counts as fragmentation only from this size (or with a ``fragmentation`` flag)."""


def new_segment_bytes(requested: int) -> int:
    """What PyTorch's caching allocator asks the driver for when no cached block fits a request
    (``get_allocation_size`` in ``CUDACachingAllocator.cpp``): a 2 MiB segment up to 1 MiB, a 20 MiB one
    under 10 MiB, else the request rounded up to 2 MiB."""
    rounded = -(-requested // _ROUNDING) * _ROUNDING
    if rounded <= _SMALL_REQUEST:
        return _SMALL_SEGMENT
    if rounded < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return -(-rounded // _LARGE_ROUNDING) * _LARGE_ROUNDING


@dataclass(frozen=True)
class Cause:
    kind: str
    """``other_process``, ``fragmentation``, ``leak_outside_pytorch``, ``leak_inside_pytorch``,
    ``outside_pytorch_jump``, ``kept_allocation``, ``cache_growth`` or ``activation_over_reserve``."""
    bytes: int
    """The bytes the evidence puts behind it: what ranks it."""
    sentence: str


@dataclass(frozen=True)
class OomFacts:
    """What the out-of-memory event recorded, as far as the causes need it."""

    step: int
    requested_bytes: int | None
    driver_free_bytes: int | None
    reserved_bytes: int | None
    allocated_bytes: int | None
    largest_cached_block_bytes: int | None

    @classmethod
    def of(cls, step: int, data: dict[str, Any]) -> OomFacts:
        return cls(step, *(_int(data.get(key)) for key in ("requested_bytes", "driver_free_bytes", "reserved_bytes",
                                                          "allocated_bytes", "largest_cached_block_bytes")))

    @property
    def free_cache_bytes(self) -> int | None:
        """Reserved by the allocator but not allocated: its cache of free blocks."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return max(self.reserved_bytes - self.allocated_bytes, 0)


def mechanism_sentence(oom: OomFacts) -> str | None:
    """Why a request failed with more than it asked for free on the device; ``None`` when it did not."""
    requested, free, largest = oom.requested_bytes, oom.driver_free_bytes, oom.largest_cached_block_bytes
    if requested is None or free is None or free < requested:
        return None
    segment = new_segment_bytes(requested)
    cached = "" if largest is None else f" (the largest free block it held was {format_bytes(largest)})"
    if segment > free:
        return (f"It failed with more than that free because no block cached by PyTorch's allocator could hold it"
                f"{cached}, and for a request of this size the allocator asks the driver for a new "
                f"{format_bytes(segment)} segment, more than the {format_bytes(free)} free.")
    return (f"It failed although the device reported {format_bytes(free)} free: the free memory was likely split "
            "between other allocations outside PyTorch's allocator, or freed only after the request.")


def rank_causes(oom: OomFacts | None, growths: list[TermGrowth], over_reserve: int | None, reserve: int | None,
                flags: list[Flag], split: OutsideSplit | None = None) -> list[Cause]:
    """The causes the facts support, most bytes first (``growths``: the terms that grew, ``flags``: the
    rank's flags up to its end; ``oom`` is ``None`` for a crash, which has no failing request; ``split``:
    the non-PyTorch growth told apart into another process's jump and a leak beside it, each its own cause)."""
    causes: list[Cause] = []
    external = next((flag for flag in flags if flag.kind == EXTERNAL_PROCESS), None)
    fragmented = next((flag for flag in flags if flag.kind == FRAGMENTATION), None)
    if external is not None and split is not None:
        causes.append(_other_process_at(external, split))
        if split.leak is not None:
            leak = _grown(split.leak, oom, fragmented)  # pragma: no mutate (a non-PyTorch leak reads neither)
            if leak is not None:
                causes.append(leak)
    elif external is not None:
        causes.append(_other_process(external, next((g for g in growths if g.term == "non_torch_bytes"), None)))
    for growth in growths:
        if not (external is not None and growth.term == "non_torch_bytes"):
            cause = _grown(growth, oom, fragmented)
            if cause is not None:
                causes.append(cause)
    if oom is not None and not any(cause.kind == "fragmentation" for cause in causes):
        cause = _split_cache(oom, fragmented)
        if cause is not None:
            causes.append(cause)
    if over_reserve is not None and reserve is not None:
        causes.append(Cause("activation_over_reserve", over_reserve, (
            f"The failing allocation was {format_bytes(over_reserve)} larger than the activation reserve warmup "
            f"measured ({format_bytes(reserve)}): warmup ran a smaller batch than serving needs, so the KV cache "
            "took memory the forward needed (an under-measured activation).")))
    # A cache that grew is reusable by PyTorch itself: a contributor at most, said after any cause.
    return sorted(causes, key=lambda cause: (cause.kind == "cache_growth", -cause.bytes))


def _other_process(flag: Flag, growth: TermGrowth | None) -> Cause:
    if growth is not None and growth.term == "non_torch_bytes":
        size, since = growth.growth_bytes, growth.since_step
    else:
        size = _int(flag.data.get("jump_bytes")) or 0
        since = _int(flag.data.get("from_step"))
    after = "" if since is None else f" after step {format_count(since)}"
    return Cause("other_process", size, (
        f"Another process took {format_bytes(size)} of this GPU{after}: memory outside PyTorch's allocator jumped "
        f"and stayed up (the external_process flag at step {format_count(flag.step)}), so that "
        "memory was gone from the budget the KV cache was sized against."))


def _other_process_at(flag: Flag, split: OutsideSplit) -> Cause:
    return Cause("other_process", split.jump_bytes, (
        f"Another process took {format_bytes(split.jump_bytes)} of this GPU at step {format_count(split.jump_step)}: "
        f"memory outside PyTorch's allocator jumped and stayed up (the external_process flag at step "
        f"{format_count(flag.step)}), so that memory was gone from the budget the KV cache was sized against."))


def _grown(growth: TermGrowth, oom: OomFacts | None, fragmented: Flag | None) -> Cause | None:
    size, since = format_bytes(growth.growth_bytes), format_count(growth.since_step)
    over = (f"over {format_count(growth.steps)} steps ({format_duration_ns(round(growth.seconds * 1e9))}), "
            f"since step {since}")
    if growth.term == "non_torch_bytes":
        if growth.jump:
            return Cause("outside_pytorch_jump", growth.growth_bytes, (
                f"Memory outside PyTorch's allocator jumped by {size} after step {since} and stayed up: one large "
                "allocation outside PyTorch (a library's workspace, NCCL) or another process on this GPU."))
        return Cause("leak_outside_pytorch", growth.growth_bytes, (
            f"Memory outside PyTorch's allocator grew by {size} {over}, while PyTorch's own numbers stayed flat: "
            "a leak outside PyTorch (a library or extension that allocates with cudaMalloc and never frees)."))
    if growth.term == "cache_slack_bytes":
        split = oom is not None and _is_split(oom)
        if fragmented is None and not split:
            return Cause("cache_growth", growth.growth_bytes, (
                f"Memory PyTorch's allocator kept cached but unused grew by {size} {over}: freed blocks it holds "
                "for its own reuse, which allocations outside PyTorch cannot use."))
        held = "" if oom is None or oom.largest_cached_block_bytes is None else (
            f"; its largest free block was {format_bytes(oom.largest_cached_block_bytes)}")
        too_small = "too small for the request" if split else "that larger allocations cannot use"
        flagged = "" if fragmented is None else f" (the fragmentation flag at step {format_count(fragmented.step)})"
        return Cause("fragmentation", growth.growth_bytes, (
            f"The allocator's fragmentation: the memory it kept cached but unused grew by {size} {over}{held}. "
            f"Free memory was split in pieces {too_small}, inside segments that still hold live tensors, which "
            f"empty_cache cannot release{flagged}."))
    if growth.steps == 0:
        return None  # the failing step's own tensors: not memory kept from before
    if growth.jump:
        return Cause("kept_allocation", growth.growth_bytes, (
            f"PyTorch-allocated memory jumped by {size} after step {since} and stayed allocated: one large "
            "allocation kept across steps."))
    return Cause("leak_inside_pytorch", growth.growth_bytes, (
        f"PyTorch-allocated memory grew by {size} {over}, and stayed allocated between steps beyond the weights "
        "and KV cache: a leak inside PyTorch; look for tensors kept across steps (outputs, logprobs or metadata "
        "held per request)."))


def _is_split(oom: OomFacts) -> bool:
    """The allocator's free cache held more than the request, but in no piece as large as it."""
    cache, largest, requested = oom.free_cache_bytes, oom.largest_cached_block_bytes, oom.requested_bytes
    return cache is not None and largest is not None and requested is not None and largest < requested <= cache


def _split_cache(oom: OomFacts, fragmented: Flag | None) -> Cause | None:
    cache, largest = oom.free_cache_bytes, oom.largest_cached_block_bytes
    if not _is_split(oom) or cache is None or largest is None:  # pragma: no mutate (_is_split needs both)
        return None
    if cache < FRAGMENTED_MIN_BYTES and fragmented is None:
        return None
    flagged = "" if fragmented is None else f" (the fragmentation flag at step {format_count(fragmented.step)})"
    return Cause("fragmentation", cache, (
        f"The allocator's fragmentation: it held {format_bytes(cache)} cached but unused, more than the request, "
        f"yet its largest free block was {format_bytes(largest)}: free memory split in pieces too small for it"
        f"{flagged}."))


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None

