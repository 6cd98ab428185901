"""Reading a PyTorch memory snapshot pickle without running anything from it.

``torch.cuda.memory._dump_snapshot`` pickles a plain dictionary: ``segments`` (one per ``cudaMalloc``,
each with its ``blocks`` and their allocation ``frames``) and ``device_traces`` (per device, the
allocator's recent actions when ``_record_memory_history`` was on: ``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``, ``segment_free``, ``snapshot``, ``oom``; each with ``addr``,
``size``, ``stream``, ``time_us`` and ``frames``; an ``oom`` entry carries ``device_free`` instead of
an address). A pickle can name any importable callable and have it called while loading, so the
loader here refuses every global: only dicts, lists, tuples, strings, numbers, booleans and ``None``
can come out of it. Anything else, a truncated file or a pickle of another shape is one
:class:`~memwatch.errors.UsageError`.

What comes out is walked field by field with type checks, never turned into text as a whole (a
list holding itself twice, sixty levels deep, would take for ever to print) and never beyond
:data:`MAX_ITEMS` entries (shared references can make a small file name billions). Text is cut at
:data:`MAX_TEXT` characters with invalid code points replaced; an entry with a number out of range
(a 5,000-digit size) is set aside and counted. The file itself is read by :mod:`.untrusted`.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any

from memwatch.errors import UsageError

MAX_ITEMS = 5_000_000
"""Segments, blocks, trace entries and frames a snapshot may hold in all."""
MAX_TEXT = 4096
"""Characters kept of a file name, function name, state or action."""
MAX_INT = 1 << 64
"""Sizes, addresses, streams and line numbers are within plus or minus this."""
MAX_TIME_US = (1 << 63) // 1000
"""A trace time becomes a nanosecond column, a 64-bit SQLite integer."""


class _PlainDataUnpickler(pickle.Unpickler):
    """An unpickler that resolves no global names, so no object from the file can run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it refers to the Python object {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it uses persistent ids")


@dataclass(frozen=True)
class Frame:
    filename: str
    line: int | None
    name: str

    def to_dict(self) -> dict[str, Any]:
        return {"filename": self.filename, "line": self.line, "name": self.name}

    def __str__(self) -> str:
        return f"{self.name} ({self.filename}:{self.line})"


@dataclass(frozen=True)
class Block:
    """A piece of a segment: a live tensor (``active_allocated``), one awaiting free, or cached (``inactive``)."""

    device: int
    segment_address: int
    address: int
    size: int
    requested_size: int | None
    state: str
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class Segment:
    device: int
    address: int
    total_size: int
    allocated_size: int
    active_size: int
    segment_type: str | None
    stream: int | None
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class TraceEntry:
    device: int
    action: str
    addr: int | None
    size: int
    stream: int | None
    time_us: int | None
    device_free: int | None
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class MemorySnapshot:
    segments: tuple[Segment, ...]
    traces: tuple[TraceEntry, ...]
    """Every device's trace, each in the order the allocator recorded it."""
    devices: tuple[int, ...] = field(default=())
    set_aside: int = 0
    """Entries left out because a number in them was out of range."""

    @property
    def reserved_bytes(self) -> int:
        return sum(segment.total_size for segment in self.segments)

    @property
    def allocated_bytes(self) -> int:
        return sum(segment.allocated_size for segment in self.segments)

    def live_blocks(self) -> list[Block]:
        """Blocks a tensor holds, largest first."""
        blocks = [b for s in self.segments for b in s.blocks if b.state == "active_allocated"]
        return sorted(blocks, key=lambda block: block.size, reverse=True)


def parse_snapshot(raw: bytes, name: str = "the snapshot") -> MemorySnapshot:
    hint = "give the pickle torch.cuda.memory._dump_snapshot wrote"
    try:
        data = _PlainDataUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise UsageError(f"{name} is not a PyTorch memory snapshot ({exc}); {hint}") from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, UnicodeDecodeError,
            OverflowError, RecursionError) as exc:
        what = "it is truncated" if isinstance(exc, EOFError) else f"it is not a valid pickle: {exc}"
        raise UsageError(f"{name} is not a readable PyTorch memory snapshot ({what}); {hint}") from None
    try:
        return _snapshot(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"{name} is not a PyTorch memory snapshot ({_shape_error(exc)}); {hint}") from None


def _shape_error(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}" if isinstance(exc.args[0], str) else "a missing field"
    return str(exc)


class _OutOfRange(Exception):
    """A number no allocator writes: the entry holding it is set aside."""


def clean_text(value: str) -> str:
    """``value`` cut to :data:`MAX_TEXT` characters, lone surrogates (invalid in UTF-8) replaced by U+FFFD."""
    value = value[:MAX_TEXT]
    return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace") if _has_surrogate(value) else value


def _has_surrogate(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class _Walk:
    """One pass over the unpickled data: type checks, the item budget and the entries set aside."""

    def __init__(self) -> None:
        self.items = 0
        self.set_aside = 0

    def count(self, n: int = 1) -> None:
        self.items += n
        if self.items > MAX_ITEMS:
            raise ValueError(f"it holds more than {MAX_ITEMS:,} entries")

    def snapshot(self, data: Any) -> MemorySnapshot:
        if not isinstance(data, dict) or "segments" not in data or "device_traces" not in data:
            raise ValueError("expected a dictionary with 'segments' and 'device_traces'")
        segments = [s for s in map(self._aside(self.segment), _list(data["segments"], "segments")) if s is not None]
        traces: list[TraceEntry] = []
        for device, entries in enumerate(_list(data["device_traces"], "device_traces")):
            self.count()
            read = self._aside(lambda entry, device=device: self.trace_entry(device, entry))
            traces.extend(t for t in map(read, _list(entries, "a device trace")) if t is not None)
        devices = sorted({s.device for s in segments} | {t.device for t in traces})
        return MemorySnapshot(tuple(segments), tuple(traces), tuple(devices), self.set_aside)

    def _aside(self, read: Any) -> Any:
        def reading(value: Any) -> Any:
            self.count()
            try:
                return read(value)
            except _OutOfRange:
                self.set_aside += 1
                return None
        return reading

    def frames(self, value: Any) -> tuple[Frame, ...]:
        frames = []
        for frame in _list(value, "frames") if value is not None else ():
            self.count()
            f = _dict(frame, "a frame")
            frames.append(Frame(_text(f.get("filename", "?"), "a frame's filename"),
                                _optional_int(f.get("line"), "a frame's line"), _text(f.get("name", "?"),
                                                                                       "a frame's name")))
        return tuple(frames)

    def segment(self, value: Any) -> Segment:
        s = _dict(value, "a segment")
        address = _int(s["address"], "a segment's address")
        device = _optional_int(s.get("device"), "a segment's device") or 0
        read = self._aside(lambda raw: self.block(device, address, raw))
        blocks = [b for b in map(read, _list(s.get("blocks", []), "a segment's blocks")) if b is not None]
        segment_type = s.get("segment_type")
        return Segment(device, address, _int(s["total_size"], "a segment's total_size"),
                       _optional_int(s.get("allocated_size"), "a segment's allocated_size") or 0,
                       _optional_int(s.get("active_size"), "a segment's active_size") or 0,
                       None if segment_type is None else _text(segment_type, "a segment's segment_type"),
                       _optional_int(s.get("stream"), "a segment's stream"), tuple(blocks))

    def block(self, device: int, segment_address: int, value: Any) -> Block:
        b = _dict(value, "a block")
        return Block(device, segment_address, _int(b["address"], "a block's address"),
                     _int(b["size"], "a block's size"),
                     _optional_int(b.get("requested_size"), "a block's requested_size"),
                     _text(b["state"], "a block's state"), self.frames(b.get("frames")))

    def trace_entry(self, device: int, value: Any) -> TraceEntry:
        e = _dict(value, "a trace entry")
        return TraceEntry(device, _text(e["action"], "a trace entry's action"),
                          _optional_int(e.get("addr"), "a trace entry's addr"),
                          _int(e["size"], "a trace entry's size"), _optional_int(e.get("stream"), "a stream"),
                          _time_us(e.get("time_us")),
                          _optional_int(e.get("device_free"), "a trace entry's device_free"),
                          self.frames(e.get("frames")))


def _snapshot(data: Any) -> MemorySnapshot:
    return _Walk().snapshot(data)


def _list(value: Any, what: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} is a {type(value).__name__}, not a list")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is a {type(value).__name__}, not a dictionary")
    return value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is not an integer")
    if not -MAX_INT < value < MAX_INT:
        raise _OutOfRange(what)
    return value


def _optional_int(value: Any, what: str = "a number") -> int | None:
    """An integer field torch may leave out: ``None`` when absent or not a number; set aside when out of range."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return _int(value, what)


def _time_us(value: Any) -> int | None:
    time_us = _optional_int(value, "a trace entry's time_us")
    if time_us is not None and not -MAX_TIME_US < time_us < MAX_TIME_US:
        raise _OutOfRange("a trace entry's time_us")
    return time_us


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} is a {type(value).__name__}, not text")
    return clean_text(value)


def to_plain(snapshot: MemorySnapshot) -> dict[str, Any]:
    """The snapshot as plain data that :func:`parse_snapshot`'s walk reads back into the same snapshot."""
    traces: list[list[dict[str, Any]]] = [[] for _ in range(max((t.device for t in snapshot.traces), default=-1) + 1)]
    for t in snapshot.traces:
        traces[t.device].append({"action": t.action, "addr": t.addr, "size": t.size, "stream": t.stream,
                                 "time_us": t.time_us, "device_free": t.device_free,
                                 "frames": [f.to_dict() for f in t.frames]})
    return {"segments": [
        {"device": s.device, "address": s.address, "total_size": s.total_size, "allocated_size": s.allocated_size,
         "active_size": s.active_size, "segment_type": s.segment_type, "stream": s.stream,
         "blocks": [{"address": b.address, "size": b.size, "requested_size": b.requested_size, "state": b.state,
                     "frames": [f.to_dict() for f in b.frames]} for b in s.blocks]}
        for s in snapshot.segments], "device_traces": traces, "set_aside": snapshot.set_aside}


def from_plain(data: dict[str, Any]) -> MemorySnapshot:
    """:func:`to_plain`'s data (from the reading child process) back into a snapshot."""
    walk = _Walk()
    snapshot = walk.snapshot(data)
    set_aside = data.get("set_aside")
    extra = set_aside if isinstance(set_aside, int) and 0 <= set_aside <= MAX_ITEMS else 0
    return MemorySnapshot(snapshot.segments, snapshot.traces, snapshot.devices, snapshot.set_aside + extra)
