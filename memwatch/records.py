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

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Sample:
        """A ``samples`` row selected in :data:`SAMPLE_COLUMNS` order (SQLite stores the flag as 0/1)."""
        return cls(*row[:15], bool(row[15]), row[16])


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
                        #  "current_bytes", "block_bytes", "num_blocks"} (+ optional "kv_cache_memory_bytes")
    "preemption",       # {"count"}
    "oom",              # {"requested_bytes", "allocated_bytes", "reserved_bytes", "driver_free_bytes", ...}
    "run_end",          # {"status"}
)
"""Event kinds the engine package emits; adapters may add engine-specific ones (documented where emitted)."""
