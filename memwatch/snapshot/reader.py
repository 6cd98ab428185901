"""Reading a PyTorch memory snapshot pickle without running anything from it, into a bounded summary.

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
:data:`MAX_ITEMS` entries (shared references can make a small file name billions). The walk keeps
only what the import stores (counts, sums, the :data:`TOP_ALLOCATIONS` largest live blocks, the last
:data:`LAST_SEGMENTS` segment growths, the last :data:`MAX_OOMS` ``oom`` entries, each with its
:data:`TOP_FRAMES` innermost useful frames), so what it holds does not grow with the entries it
reads: one frame shared by 500,000 trace entries costs a count, not 500,000 copies. Text is cut at
:data:`MAX_TEXT` characters with invalid code points replaced; an entry with a number out of range
(a 5,000-digit size) is set aside and counted. The file itself is read by :mod:`.untrusted`.
"""

from __future__ import annotations

import heapq
import io
import pickle
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any

from memwatch.errors import UsageError

MAX_ITEMS = 5_000_000
"""Segments, blocks, trace entries and frames a snapshot may hold in all."""
MAX_TEXT = 4096
"""Characters kept of a file name, function name, state or action."""
MAX_INT = 1 << 64
"""Sizes, addresses, streams and line numbers are within plus or minus this."""
MAX_TIME_US = (1 << 63) // 1000
"""A trace time becomes a nanosecond column, a 64-bit SQLite integer."""
TOP_ALLOCATIONS = 10
"""Largest live blocks kept."""
TOP_FRAMES = 5
"""Innermost frames kept of a block or trace entry (the allocator's own Python wrappers skipped)."""
LAST_SEGMENTS = 10
"""Last ``segment_alloc`` trace entries kept."""
MAX_OOMS = 16
"""Last ``oom`` trace entries kept (a library that retries a smaller request can cause several)."""
MAX_ACTIONS = 64
"""Distinct trace actions counted by name; the rest are counted under :data:`OTHER_ACTIONS`."""
MAX_ACTION_NAME = 64
"""Characters of an action counted by name (torch's are short); a longer one is counted under :data:`OTHER_ACTIONS`."""
OTHER_ACTIONS = "(other)"
MAX_DEVICES = 256
"""Distinct device numbers listed."""
_WRAPPERS = ("torch/cuda/memory.py", "torch/_tensor.py")


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
    """A live piece of a segment (``active_allocated``): a tensor's memory."""

    device: int
    segment_address: int
    address: int
    size: int
    requested_size: int | None
    state: str
    frames: tuple[Frame, ...]
    """The innermost :data:`TOP_FRAMES` frames that are not the allocator's own wrappers."""


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
    """As :attr:`Block.frames`."""


@dataclass(frozen=True)
class MemorySnapshot:
    """What an import stores of a snapshot: bounded whatever the file held."""

    devices: tuple[int, ...] = ()
    segments: int = 0
    reserved_bytes: int = 0
    allocated_bytes: int = 0
    live_allocations: int = 0
    largest: tuple[Block, ...] = ()
    """The largest live blocks, largest first (ties in the file's order)."""
    trace_entries: int = 0
    trace_actions: dict[str, int] = field(default_factory=dict)
    segment_allocs: int = 0
    segment_alloc_bytes: int = 0
    segment_frees: int = 0
    segment_free_bytes: int = 0
    last_segment_allocs: tuple[TraceEntry, ...] = ()
    ooms: tuple[TraceEntry, ...] = ()
    """The trace's last ``oom`` entries, in the order the allocator recorded them."""
    oom_time_us: int | None = None
    """The time of the trace's last ``oom`` entry that has one: the snapshot's moment."""
    set_aside: int = 0
    """Entries left out because a number in them was out of range."""


def parse_snapshot(source: bytes | IO[bytes], name: str = "the snapshot") -> MemorySnapshot:
    """The summary of the pickle in ``source``: bytes, or a binary file the loader reads as it goes."""
    hint = "give the pickle torch.cuda.memory._dump_snapshot wrote"
    try:
        data = _PlainDataUnpickler(io.BytesIO(source) if isinstance(source, bytes) else source).load()
    except pickle.UnpicklingError as exc:
        raise UsageError(f"{name} is not a PyTorch memory snapshot ({exc}); {hint}") from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, UnicodeDecodeError,
            OverflowError, RecursionError) as exc:
        what = "it is truncated" if isinstance(exc, EOFError) else f"it is not a valid pickle: {exc}"
        raise UsageError(f"{name} is not a readable PyTorch memory snapshot ({what}); {hint}") from None
    try:
        return _Walk().snapshot(data)
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
    value = value[:MAX_TEXT]  # the same object when it is short enough: a shared frame costs no copy
    if value.isascii() or not _has_surrogate(value):
        return value
    return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _has_surrogate(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class _Top:
    """The ``n`` largest blocks seen, ties kept in the order they came: a heap of ``n``, not a list of all."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.heap: list[tuple[int, int, Block]] = []
        self.seen = 0

    def add(self, block: Block) -> None:
        self.seen += 1
        item = (block.size, -self.seen, block)
        if len(self.heap) < self.n:
            heapq.heappush(self.heap, item)
        elif item[:2] > self.heap[0][:2]:
            heapq.heapreplace(self.heap, item)

    def blocks(self) -> list[Block]:
        return [block for _, _, block in sorted(self.heap, key=lambda item: item[:2], reverse=True)]


class _Walk:
    """One pass over the unpickled data: type checks, the item budget, the entries set aside, the summary."""

    def __init__(self) -> None:
        self.items = 0
        self.set_aside = 0
        self.devices: set[int] = set()
        self.segments = self.reserved = self.allocated = self.live = 0
        self.top = _Top(TOP_ALLOCATIONS)
        self.entries = 0
        self.actions: dict[str, int] = {}
        self.grown: deque[TraceEntry] = deque(maxlen=LAST_SEGMENTS)
        self.grown_count = self.grown_bytes = self.freed_count = self.freed_bytes = 0
        self.ooms: deque[TraceEntry] = deque(maxlen=MAX_OOMS)
        self.oom_time_us: int | None = None

    def count(self, n: int = 1) -> None:
        self.items += n
        if self.items > MAX_ITEMS:
            raise ValueError(f"it holds more than {MAX_ITEMS:,} entries")

    def device(self, device: int) -> None:
        if len(self.devices) < MAX_DEVICES:
            self.devices.add(device)

    def snapshot(self, data: Any) -> MemorySnapshot:
        if not isinstance(data, dict) or "segments" not in data or "device_traces" not in data:
            raise ValueError("expected a dictionary with 'segments' and 'device_traces'")
        for value in _list(data["segments"], "segments"):
            self.aside(self.segment, value)
        for device, entries in enumerate(_list(data["device_traces"], "device_traces")):
            self.count()
            for value in _list(entries, "a device trace"):
                self.aside(self.trace_entry, device, value)
        return MemorySnapshot(
            tuple(sorted(self.devices)), self.segments, self.reserved, self.allocated, self.live,
            tuple(self.top.blocks()), self.entries, self.actions, self.grown_count, self.grown_bytes,
            self.freed_count, self.freed_bytes, tuple(self.grown), tuple(self.ooms), self.oom_time_us,
            self.set_aside)

    def aside(self, read: Any, *args: Any) -> None:
        """Count one entry and read it; one with a number out of range is set aside."""
        self.count()
        try:
            read(*args)
        except _OutOfRange:
            self.set_aside += 1

    def frames(self, value: Any) -> tuple[Frame, ...]:
        """Every frame checked; the first :data:`TOP_FRAMES` useful ones kept (else the first ones)."""
        useful: list[Frame] = []
        first: list[Frame] = []
        for frame in _list(value, "frames") if value is not None else ():
            self.count()
            f = _dict(frame, "a frame")
            filename = _text(f.get("filename", "?"), "a frame's filename")
            line = _optional_int(f.get("line"), "a frame's line")
            name = _text(f.get("name", "?"), "a frame's name")
            if len(useful) < TOP_FRAMES and not filename.endswith(_WRAPPERS):
                useful.append(Frame(filename, line, name))
            if len(first) < TOP_FRAMES:
                first.append(Frame(filename, line, name))
        return tuple(useful or first)

    def segment(self, value: Any) -> None:
        s = _dict(value, "a segment")
        address = _int(s["address"], "a segment's address")
        device = _optional_int(s.get("device"), "a segment's device") or 0
        top = _Top(TOP_ALLOCATIONS)  # joined to the snapshot's only once the whole segment is read
        live = 0
        for raw in _list(s.get("blocks", []), "a segment's blocks"):
            self.count()
            try:
                block = self.block(device, address, raw)
            except _OutOfRange:
                self.set_aside += 1
                continue
            if block.state == "active_allocated":
                live += 1
                top.add(block)
        total = _int(s["total_size"], "a segment's total_size")
        allocated = _optional_int(s.get("allocated_size"), "a segment's allocated_size") or 0
        _optional_int(s.get("active_size"), "a segment's active_size")
        segment_type = s.get("segment_type")
        if segment_type is not None:
            _text(segment_type, "a segment's segment_type")
        _optional_int(s.get("stream"), "a segment's stream")
        self.segments += 1
        self.reserved += total
        self.allocated += allocated
        self.live += live
        self.device(device)
        for block in top.blocks():
            self.top.add(block)

    def block(self, device: int, segment_address: int, value: Any) -> Block:
        b = _dict(value, "a block")
        return Block(device, segment_address, _int(b["address"], "a block's address"),
                     _int(b["size"], "a block's size"),
                     _optional_int(b.get("requested_size"), "a block's requested_size"),
                     _text(b["state"], "a block's state"), self.frames(b.get("frames")))

    def trace_entry(self, device: int, value: Any) -> None:
        e = _dict(value, "a trace entry")
        entry = TraceEntry(device, _text(e["action"], "a trace entry's action"),
                           _optional_int(e.get("addr"), "a trace entry's addr"),
                           _int(e["size"], "a trace entry's size"), _optional_int(e.get("stream"), "a stream"),
                           _time_us(e.get("time_us")),
                           _optional_int(e.get("device_free"), "a trace entry's device_free"),
                           self.frames(e.get("frames")))
        self.entries += 1
        self.device(device)
        action = entry.action
        if len(action) > MAX_ACTION_NAME or (action not in self.actions and len(self.actions) >= MAX_ACTIONS):
            action = OTHER_ACTIONS
        self.actions[action] = self.actions.get(action, 0) + 1
        if entry.action == "segment_alloc":
            self.grown.append(entry)
            self.grown_count += 1
            self.grown_bytes += entry.size
        elif entry.action == "segment_free":
            self.freed_count += 1
            self.freed_bytes += entry.size
        elif entry.action == "oom":
            self.ooms.append(entry)
            if entry.time_us:
                self.oom_time_us = entry.time_us


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
