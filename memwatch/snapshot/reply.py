"""The reading child's answer: a snapshot's summary as JSON, bounded in bytes and values, checked again here.

The child parses a file nobody vouches for, so its answer is outside input too. The parent reads at
most :data:`MAX_REPLY_BYTES` of it; :func:`parse_reply` takes only ASCII with at most
:data:`MAX_REPLY_VALUES` values outside its strings, so what ``json.loads`` builds from it is a few
times its size at most (3 bytes of ``[],`` would otherwise become a 64-byte list); and
:func:`from_plain` takes nothing the child would not have written (each field's type and range, each
list's length, each text's length). A summary holds at most 36 entries of 5 frames (360 texts of
4,096 characters, each at most 12 bytes escaped) and 64 short action names, so an honest answer stays
under 18 MiB whatever the file held.
"""

from __future__ import annotations

import json
import re
from typing import Any

from memwatch.snapshot.reader import (
    LAST_SEGMENTS,
    MAX_ACTION_NAME,
    MAX_ACTIONS,
    MAX_DEVICES,
    MAX_INT,
    MAX_ITEMS,
    MAX_OOMS,
    MAX_TEXT,
    MAX_TIME_US,
    TOP_ALLOCATIONS,
    TOP_FRAMES,
    Block,
    Frame,
    MemorySnapshot,
    TraceEntry,
    clean_text,
)

MAX_REPLY_BYTES = 18 << 20
"""Bytes of JSON the parent reads from the child."""
MAX_REPLY_VALUES = 4096
"""Commas and opening brackets outside strings in an answer (an honest one has under 1,500)."""
MAX_ERROR = 8192
"""Characters of the reason the child gives for a file it refused."""
_MAX_SUM = MAX_ITEMS * MAX_INT
_SHA256_HEX = frozenset("0123456789abcdef")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def to_plain(snapshot: MemorySnapshot, sha256: str) -> dict[str, Any]:
    """The summary as plain data that :func:`from_plain` reads back into the same summary."""
    return {
        "sha256": sha256, "devices": list(snapshot.devices), "segments": snapshot.segments,
        "reserved_bytes": snapshot.reserved_bytes, "allocated_bytes": snapshot.allocated_bytes,
        "live_allocations": snapshot.live_allocations, "largest": [_block(b) for b in snapshot.largest],
        "trace_entries": snapshot.trace_entries, "trace_actions": snapshot.trace_actions,
        "segment_allocs": snapshot.segment_allocs, "segment_alloc_bytes": snapshot.segment_alloc_bytes,
        "segment_frees": snapshot.segment_frees, "segment_free_bytes": snapshot.segment_free_bytes,
        "last_segment_allocs": [_entry(t) for t in snapshot.last_segment_allocs],
        "ooms": [_entry(t) for t in snapshot.ooms], "oom_time_us": snapshot.oom_time_us,
        "set_aside": snapshot.set_aside,
    }


def _block(b: Block) -> dict[str, Any]:
    return {"device": b.device, "segment_address": b.segment_address, "address": b.address, "size": b.size,
            "requested_size": b.requested_size, "state": b.state, "frames": [f.to_dict() for f in b.frames]}


def _entry(t: TraceEntry) -> dict[str, Any]:
    return {"device": t.device, "action": t.action, "addr": t.addr, "size": t.size, "stream": t.stream,
            "time_us": t.time_us, "device_free": t.device_free, "frames": [f.to_dict() for f in t.frames]}


def parse_reply(raw: bytes) -> Any:
    """The child's JSON, once it is known to be ASCII with few values; ``ValueError`` otherwise."""
    if not raw.isascii():
        raise ValueError("the answer is not ASCII")
    skeleton = _STRING.sub(b'""', raw)
    if skeleton.count(b",") + skeleton.count(b"[") + skeleton.count(b"{") > MAX_REPLY_VALUES:
        raise ValueError(f"the answer holds more than {MAX_REPLY_VALUES:,} values")
    del skeleton
    return json.loads(raw)


def from_plain(data: Any) -> tuple[MemorySnapshot, str]:
    """:func:`to_plain`'s data back into a summary and the file's SHA-256; ``ValueError`` for anything else."""
    d = _dict(data, "the answer")
    sha256 = d["sha256"]
    if not isinstance(sha256, str) or len(sha256) != 64 or not set(sha256) <= _SHA256_HEX:
        raise ValueError("sha256 is not 64 hexadecimal digits")
    actions = _dict(d["trace_actions"], "trace_actions")
    if len(actions) > MAX_ACTIONS + 1:
        raise ValueError("trace_actions has too many names")
    snapshot = MemorySnapshot(
        devices=tuple(_int(v, "a device") for v in _list(d["devices"], "devices", MAX_DEVICES)),
        segments=_count(d["segments"], "segments"),
        reserved_bytes=_int(d["reserved_bytes"], "reserved_bytes", _MAX_SUM),
        allocated_bytes=_int(d["allocated_bytes"], "allocated_bytes", _MAX_SUM),
        live_allocations=_count(d["live_allocations"], "live_allocations"),
        largest=tuple(_read_block(v) for v in _list(d["largest"], "largest", TOP_ALLOCATIONS)),
        trace_entries=_count(d["trace_entries"], "trace_entries"),
        trace_actions={_text(k, "an action", MAX_ACTION_NAME): _count(v, "an action's count")
                       for k, v in actions.items()},
        segment_allocs=_count(d["segment_allocs"], "segment_allocs"),
        segment_alloc_bytes=_int(d["segment_alloc_bytes"], "segment_alloc_bytes", _MAX_SUM),
        segment_frees=_count(d["segment_frees"], "segment_frees"),
        segment_free_bytes=_int(d["segment_free_bytes"], "segment_free_bytes", _MAX_SUM),
        last_segment_allocs=tuple(_read_entry(v) for v in _list(d["last_segment_allocs"], "last_segment_allocs",
                                                                 LAST_SEGMENTS)),
        ooms=tuple(_read_entry(v) for v in _list(d["ooms"], "ooms", MAX_OOMS)),
        oom_time_us=_optional(d["oom_time_us"], "oom_time_us", MAX_TIME_US),
        set_aside=_count(d["set_aside"], "set_aside"),
    )
    return snapshot, sha256


def _read_frames(value: Any) -> tuple[Frame, ...]:
    frames = []
    for frame in _list(value, "frames", TOP_FRAMES):
        f = _dict(frame, "a frame")
        frames.append(Frame(_text(f["filename"], "a filename"), _optional(f["line"], "a line"), _text(f["name"],
                                                                                                     "a name")))
    return tuple(frames)


def _read_block(value: Any) -> Block:
    b = _dict(value, "a block")
    return Block(_int(b["device"], "a device"), _int(b["segment_address"], "a segment address"),
                 _int(b["address"], "an address"), _int(b["size"], "a size"),
                 _optional(b["requested_size"], "a requested size"), _text(b["state"], "a state"),
                 _read_frames(b["frames"]))


def _read_entry(value: Any) -> TraceEntry:
    t = _dict(value, "a trace entry")
    return TraceEntry(_int(t["device"], "a device"), _text(t["action"], "an action"), _optional(t["addr"], "an addr"),
                      _int(t["size"], "a size"), _optional(t["stream"], "a stream"),
                      _optional(t["time_us"], "a time", MAX_TIME_US), _optional(t["device_free"], "device_free"),
                      _read_frames(t["frames"]))


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not an object")
    return value


def _list(value: Any, what: str, most: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > most:
        raise ValueError(f"{what} is not a list of at most {most}")
    return value


def _int(value: Any, what: str, bound: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -bound < value < bound:
        raise ValueError(f"{what} is not an integer in range")
    return value


def _count(value: Any, what: str) -> int:
    if _int(value, what, MAX_ITEMS + 1) < 0:
        raise ValueError(f"{what} is negative")
    return value


def _optional(value: Any, what: str, bound: int = MAX_INT) -> int | None:
    return None if value is None else _int(value, what, bound)


def _text(value: Any, what: str, most: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > most:
        raise ValueError(f"{what} is not text of at most {most} characters")
    return clean_text(value)
