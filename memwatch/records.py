"""The two record shapes everything outside the engine speaks: a sample and an event.

They mirror the ``samples`` and ``events`` tables column for column (the tables are a public
contract), so the collector, the ledger, the detectors and the post-mortem commands all pass the
same tuples around. ``None`` means "not available" for any measured field.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple


class Sample(NamedTuple):
    """One reading of one rank at one engine step (a row of ``samples``)."""

    run_id: str
    rank: int
    step: int
    ts_ns: int
    phase: str | None
    allocated_bytes: int | None
    peak_bytes: int | None
    reserved_bytes: int | None
    driver_used_bytes: int | None
    driver_free_bytes: int | None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    num_seqs: int | None = None
    num_tokens: int | None = None
    step_kind: str | None = None
    """``prefill``, ``decode`` or ``None`` when the engine did not say."""
    peak_is_step: bool = False
    """True when ``peak_bytes`` is this step's own peak (the allocator peak was reset after it)."""
    process_used_bytes: int | None = None
    """What NVML attributes to the process on this GPU (``attach --record`` runs; NULL otherwise)."""
    segments: int | None = None
    """The caching allocator's segment count (``segment.all.current``)."""
    active_bytes: int | None = None
    """Bytes in blocks tensors use (``active_bytes.all.current``; ``allocated`` plus blocks awaiting streams)."""
    inactive_split_bytes: int | None = None
    """Free bytes inside partly used segments: cached memory ``empty_cache`` cannot release (pinned)."""
    alloc_retries: int | None = None
    """Times the allocator flushed its cache and retried a failed ``cudaMalloc`` (cumulative)."""
    num_ooms: int | None = None
    """Out-of-memory errors the allocator raised (cumulative)."""

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Sample:
        """A ``samples`` row selected in :data:`SAMPLE_COLUMNS` order (SQLite stores the flag as 0/1)."""
        return cls(*row[:15], bool(row[15]), *row[16:])

    @property
    def reclaimable_cache_bytes(self) -> int | None:
        """Cached bytes in wholly free segments (``reserved - active - inactive_split``), ``None`` if unknown.

        The allocator gives them back to the driver and retries before it raises an OOM.
        """
        reserved, active, pinned = self.reserved_bytes, self.active_bytes, self.inactive_split_bytes
        if reserved is None or active is None or pinned is None:
            return None
        return max(reserved - active - pinned, 0)


SAMPLE_COLUMNS: tuple[str, ...] = Sample._fields


class Event(NamedTuple):
    """Something that happened once: a phase boundary, the KV sizing, a preemption, an OOM (``events``)."""

    run_id: str
    rank: int
    step: int
    ts_ns: int
    kind: str
    data: dict[str, Any]

    def to_row(self) -> tuple[Any, ...]:
        return (self.run_id, self.rank, self.step, self.ts_ns, self.kind, json.dumps(self.data))


EVENT_COLUMNS: tuple[str, ...] = Event._fields

EVENT_KINDS: tuple[str, ...] = (
    "phase_start",      # {"phase": name}
    "phase_end",        # {"phase": name}
    "weights_loaded",   # {"weights_bytes", "allocated_bytes", "peak_bytes", "reserved_bytes"}
    "kv_allocated",     # {"total_bytes", "gpu_memory_utilization", "used_bytes", "peak_bytes",
                        #  "current_bytes", "block_bytes", "num_blocks"} (+ optional "kv_cache_memory_bytes",
                        #  "budget_rule": the sizing rule the adapter claims)
    "preemption",       # {"count"}
    "rank_identity",    # {"role", "dp_rank", "dp_size", "tp_rank", "pp_rank"}: where a data-parallel rank sits
    "oom",              # {"requested_bytes", "allocated_bytes", "reserved_bytes", "driver_free_bytes", ...}
    "run_end",          # {"status"}
)
"""Event kinds the engine package emits; adapters may add engine-specific ones (documented where emitted)."""
