"""What the sidecar checks in every record and ring header before anything else sees them.

A ring is written by a process memwatch does not control: a foreign writer, a buggy adapter, or a
hostile user can put any JSON in an event and any integer in a sample. The detectors, the ledger and
SQLite each fail differently on a value of the wrong type or size (an ``OverflowError`` for a number
SQLite cannot hold, a ``TypeError`` for text where bytes were expected), and a record that fails
after it was stored fails again on every read. So each record is checked here against the fields of
its kind (:data:`EVENT_FIELDS`, :data:`META_FIELDS`); one that fails is set aside with the reason.
"""

from __future__ import annotations

import json
import math
from operator import itemgetter
from typing import Any, NamedTuple

from memwatch_engine.ring import RECORD_SIZE, TYPE_SAMPLE

MAX_INT = (1 << 63) - 1
"""The largest integer SQLite stores as an integer; bytes, counts and steps are 0 up to it."""
MAX_TS_NS = 1 << 62
"""Timestamps are nanoseconds from 0 up to 2**62 (the year 2116): differences of two stay in SQLite's range."""
MAX_TEXT = 4096
"""Characters in one text field of an event or of a ring's metadata (the engine cuts at 1,025)."""
MAX_KIND = 64
"""Characters in an event kind."""
MAX_BYTES = (1 << 56) - 1
"""Bytes of one reading (allocator, driver, an event's sizes) and tokens of one step: 0 up to 2**56 - 1, 64 PiB,
200,000 times the largest GPU memory made (288 GB). The top byte of such a value is zero, which the screen reads
at C speed, and 128 of them still add up within SQLite's integers (``abs``, sums and differences never overflow,
as ``abs(-2**63)`` did)."""
MAX_INT32 = (1 << 31) - 1


class Field(NamedTuple):
    """A field's type (``int``, ``number`` or ``text``), its range (length for text), and whether null is allowed."""

    type: str
    low: float = 0
    high: float = MAX_INT
    nullable: bool = True


BYTES = Field("int", 0, MAX_BYTES)
COUNT = Field("int")
NAME = Field("text", 0, MAX_TEXT)
FRACTION = Field("number", 0, 1)
REQUEST_ID = Field("id", 0, MAX_TEXT, nullable=False)

EVENT_FIELDS: dict[str, dict[str, Field]] = {
    "phase_start": {"phase": Field("text", 0, MAX_TEXT, nullable=False), "code": Field("int", 0, 255)},
    "phase_end": {"phase": Field("text", 0, MAX_TEXT, nullable=False)},
    "weights_loaded": {"weights_bytes": BYTES, "allocated_bytes": BYTES, "peak_bytes": BYTES,
                       "reserved_bytes": BYTES},
    "kv_allocated": {"total_bytes": BYTES, "gpu_memory_utilization": FRACTION, "used_bytes": BYTES,
                     "peak_bytes": BYTES, "current_bytes": BYTES, "reserved_bytes": BYTES, "block_bytes": BYTES,
                     "num_blocks": COUNT, "block_size": COUNT, "kv_cache_memory_bytes": BYTES, "budget_rule": NAME},
    "preemption": {"count": COUNT},
    "rank_identity": {"role": NAME, "dp_rank": COUNT, "dp_size": COUNT, "tp_rank": COUNT, "pp_rank": COUNT},
    "oom": {"requested_bytes": BYTES, "allocated_bytes": BYTES, "peak_bytes": BYTES, "reserved_bytes": BYTES,
            "driver_used_bytes": BYTES, "driver_free_bytes": BYTES, "snapshot_path": NAME},
    "run_end": {"status": NAME},
    "request_arrived": {"request_id": REQUEST_ID, "prompt_tokens": Field("int", nullable=False),
                        "max_tokens": COUNT},
    "request_finished": {"request_id": REQUEST_ID, "output_tokens": Field("int", nullable=False)},
}
"""Each event kind's decoded fields the sidecar reads, with their type and range. A field may be absent
unless it is not nullable; fields not listed (an adapter's extras, ``config``) get :func:`check_value`."""

META_FIELDS: dict[str, Field] = {
    "engine": NAME, "model": NAME, "hostname": NAME, "source": NAME, "gpu_name": NAME, "gpu_uuid": NAME,
    "probe": NAME, "probe_unavailable": NAME, "pid": Field("int", 0, (1 << 32) - 1),
    "device_index": Field("int", 0, 65535), "gpu_total_bytes": BYTES, "config": Field("object"),
}
"""The ring metadata fields the sidecar stores in ``runs`` and ``ranks``."""

SAMPLE_RANGES: dict[int, tuple[str, int]] = {5: ("step", MAX_INT), 6: ("ts_ns", MAX_TS_NS)}
"""Raw ring sample fields (by position) that are always there: name and upper bound (0 is the lower)."""
MEASURED_RANGES: dict[int, tuple[str, int, int]] = {
    7: ("allocated", 32, MAX_BYTES), 8: ("peak", 40, MAX_BYTES), 9: ("reserved", 48, MAX_BYTES),
    10: ("driver_used", 56, MAX_BYTES), 11: ("driver_free", 64, MAX_BYTES), 12: ("num_tokens", 72, MAX_BYTES),
    13: ("kv_used", 80, MAX_INT32), 14: ("kv_total", 84, MAX_INT32), 15: ("num_seqs", 88, MAX_INT32),
    16: ("segments", 92, MAX_INT32), 17: ("active", 96, MAX_BYTES), 18: ("inactive_split", 104, MAX_BYTES),
    19: ("alloc_retries", 112, MAX_INT32), 20: ("num_ooms", 116, MAX_INT32),
}
"""Raw ring sample readings (by position): name, offset in the slot, and upper bound. Each is 0 up to the bound,
or -1 (not measured); a version 1 ring's samples stop before ``segments``."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_field(name: str, value: Any, field: Field) -> str | None:
    """Why ``value`` is not a valid ``name``, or ``None`` when it is."""
    if value is None:
        return None if field.nullable else f"{name} is missing"
    if field.type == "object":
        return None if isinstance(value, dict) else f"{name} is {type(value).__name__}, not an object"
    if field.type == "text" or (field.type == "id" and isinstance(value, str)):
        if not isinstance(value, str):
            return f"{name} is {type(value).__name__}, not text"
        return None if len(value) <= field.high else f"{name} is {len(value):,} characters (at most {field.high:,})"
    if field.type in ("int", "id"):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} is {type(value).__name__}, not an integer"
        low, high = (-MAX_INT - 1, MAX_INT) if field.type == "id" else (field.low, field.high)
    else:
        if not _number(value):
            return f"{name} is {type(value).__name__}, not a number"
        if not math.isfinite(value):
            return f"{name} is {value}, not a finite number"
        low, high = field.low, field.high
    if not low <= value <= high:
        return f"{name} is {_short(value)}, outside {low:g}..{high:g}" if field.type == "number" else \
            f"{name} is {_short(value)}, outside {low}..{high}"
    return None


def check_value(name: str, value: Any, depth: int = 0) -> str | None:
    """Any decoded JSON value: finite numbers, integers SQLite can hold, bounded text, bounded nesting."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if -MAX_INT - 1 <= value <= MAX_INT else f"{name} is {_short(value)}, beyond a 64-bit integer"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{name} is {value}, not a finite number"
    if isinstance(value, str):
        return None if len(value) <= MAX_TEXT else f"{name} is {len(value):,} characters (at most {MAX_TEXT:,})"
    if depth >= 32:
        return f"{name} is nested deeper than 32"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
    if items is None:
        return f"{name} is {type(value).__name__}"
    for key, item in items:
        why = check_value(f"{name}.{key}", item, depth + 1)
        if why:
            return why
    return None


def check_event(step: Any, ts_ns: Any, kind: Any, data: Any) -> str | None:
    """Why a decoded event cannot be taken, or ``None``: its step and time, its kind, each known field of it."""
    why = check_field("step", step, Field("int", nullable=False)) or check_field(
        "ts_ns", ts_ns, Field("int", 0, MAX_TS_NS, nullable=False))
    if why:
        return f"event {why}"
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
        return f"event kind is not 1 to {MAX_KIND} characters of text"
    if not isinstance(data, dict):
        return f"{kind} event data is not an object"
    fields = EVENT_FIELDS.get(kind, {})
    for name, field in fields.items():
        why = check_field(name, data.get(name), field)
        if why:
            return f"{kind} event: {why}"
    why = check_value("data", {k: v for k, v in data.items() if k not in fields})
    return f"{kind} event: {why}" if why else None


def check_sample(record: tuple[Any, ...]) -> str | None:
    """Why a raw ring sample cannot be taken (a negative or far-future step or time, a reading below -1 or past
    its bound), or ``None``."""
    for at, (name, high) in SAMPLE_RANGES.items():
        if not 0 <= record[at] <= high:
            return f"sample {name} is {record[at]}, outside 0..{high}"
    for at, (name, _, high) in MEASURED_RANGES.items():
        if at < len(record) and not -1 <= record[at] <= high:
            return f"sample {name} is {record[at]}, outside 0..{high} (or -1: not measured)"
    return None


def check_meta(meta: Any) -> str | None:
    """Why a ring's decoded metadata cannot be stored, or ``None``."""
    if not isinstance(meta, dict):
        return "metadata is not a JSON object"
    for name, field in META_FIELDS.items():
        why = check_field(name, meta.get(name), field)
        if why:
            return f"metadata {why}"
    why = check_value("metadata", meta)
    return why


def _short(value: Any) -> str:
    """A number for a message: a huge integer by its size (``str`` of one over 4,300 digits raises)."""
    if isinstance(value, int) and abs(value) >= 10**30:
        return f"{'-' if value < 0 else ''}a number of {value.bit_length()} bits"
    return str(value)[:40]


_TOP_BYTES = ((16 + 7, 0x80), (24 + 7, 0x40))
"""The most significant byte of a slot's step and of its time (both little-endian 8 bytes; an event chunk's sit at
the same places), and what it stays under when the value is in :data:`SAMPLE_RANGES`: 0 up to 2**63 - 1 for the
step, up to 2**62 for the time (a time of exactly 2**62 goes the slower way, and passes there)."""


def _in_range_by_bytes(slots: bytes) -> bool:
    """Whether every slot's step and time are in range, read from the copied slots at C speed."""
    return bool(slots) and all(max(slots[at::RECORD_SIZE]) < bound for at, bound in _TOP_BYTES)


_SAMPLE_TOP = bytes(0xFF if kind == TYPE_SAMPLE else 0 for kind in range(256))
_SAMPLE_SIGN = bytes(0x80 if kind == TYPE_SAMPLE else 0 for kind in range(256))


def _unsure_readings(slots: bytes, samples: list[tuple[Any, ...]]) -> list[int]:
    """The readings whose top byte is not that of an in-range value (zero for 8-byte readings, under 0x80 for
    4-byte ones) in some sample slot: -1 where not measured, or out of range. Read at C speed: each field's top
    bytes as one integer, masked to the sample slots (an event's chunk holds text at those places)."""
    if not slots:
        return list(MEASURED_RANGES)
    kinds = slots[8::RECORD_SIZE]
    samples_only = int.from_bytes(kinds.translate(_SAMPLE_TOP), "little")
    sign_only = int.from_bytes(kinds.translate(_SAMPLE_SIGN), "little")
    width = len(samples[0])
    unsure = []
    for at, (_, offset, high) in MEASURED_RANGES.items():
        if at >= width:
            continue
        top = offset + (7 if high == MAX_BYTES else 3)
        if int.from_bytes(slots[top::RECORD_SIZE], "little") & (samples_only if high == MAX_BYTES else sign_only):
            unsure.append(at)
    return unsure


def _readings_in_range(slots: bytes, samples: list[tuple[Any, ...]]) -> bool:
    """Whether every reading of every sample is -1 or within its bound: the unsure ones by their minimum and
    maximum (a column of -1, a card without NVML, costs one pass)."""
    return all(min(map(itemgetter(at), samples)) >= -1 and max(map(itemgetter(at), samples)) <= MEASURED_RANGES[at][2]
               for at in _unsure_readings(slots, samples))


def screen(drained: Any) -> Any:
    """``drained`` with every sample and event that fails its checks moved to ``drained.bad`` with the reason.

    Samples are checked at C speed (the top byte of each field in the copied slots, else the minimum and
    maximum of each field) and one by one only when some value is out of range: the sidecar reads 64,000 of
    them a second.
    """
    samples = drained.samples
    if samples and not ((_in_range_by_bytes(drained.slots) or all(
            min(map(itemgetter(at), samples)) >= 0 and max(map(itemgetter(at), samples)) <= high
            for at, (_, high) in SAMPLE_RANGES.items())) and _readings_in_range(drained.slots, samples)):
        kept = []
        for record in samples:
            why = check_sample(record)
            if why:
                drained.bad.append((record[0], record[6] if 0 <= record[6] <= MAX_TS_NS else 0, why,
                                    json.dumps(list(record)).encode()))
            else:
                kept.append(record)
        drained.samples = kept
    if drained.events:
        kept_events = []
        for event in drained.events:
            seq, step, ts_ns, kind, data = event
            why = check_event(step, ts_ns, kind, data)
            if why:
                drained.bad.append((seq, ts_ns if 0 <= ts_ns <= MAX_TS_NS else 0, why,
                                    json.dumps([kind, data]).encode()))
            else:
                kept_events.append(event)
        drained.events = kept_events
    return drained
