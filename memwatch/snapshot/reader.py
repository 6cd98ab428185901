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
"""

from __future__ import annotations

import hashlib
import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memwatch.errors import NotFoundError, UsageError


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


def read_snapshot(path: str | Path) -> tuple[MemorySnapshot, str]:
    """Load and validate a snapshot file, with the SHA-256 of its bytes; one :class:`UsageError` if it is not one."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise NotFoundError(f"no snapshot file {path}; give the path torch.cuda.memory._dump_snapshot wrote") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}; check the path and its permissions") from None
    return parse_snapshot(raw, str(path)), hashlib.sha256(raw).hexdigest()


def parse_snapshot(raw: bytes, name: str = "the snapshot") -> MemorySnapshot:
    hint = "give the pickle torch.cuda.memory._dump_snapshot wrote"
    try:
        data = _PlainDataUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise UsageError(f"{name} is not a PyTorch memory snapshot ({exc}); {hint}") from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, UnicodeDecodeError,
            OverflowError, MemoryError, RecursionError) as exc:
        what = "it is truncated" if isinstance(exc, EOFError) else f"it is not a valid pickle: {exc}"
        raise UsageError(f"{name} is not a readable PyTorch memory snapshot ({what}); {hint}") from None
    try:
        return _snapshot(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"{name} is not a PyTorch memory snapshot ({_shape_error(exc)}); {hint}") from None


def _shape_error(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}"
    return str(exc)


def _snapshot(data: Any) -> MemorySnapshot:
    if not isinstance(data, dict) or "segments" not in data or "device_traces" not in data:
        raise ValueError("expected a dictionary with 'segments' and 'device_traces'")
    segments = tuple(_segment(s) for s in _list(data["segments"], "segments"))
    traces: list[TraceEntry] = []
    for device, entries in enumerate(_list(data["device_traces"], "device_traces")):
        traces.extend(_trace_entry(device, entry) for entry in _list(entries, "a device trace"))
    devices = sorted({s.device for s in segments} | {t.device for t in traces})
    return MemorySnapshot(segments, tuple(traces), tuple(devices))


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
    return value


def _optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _frames(value: Any) -> tuple[Frame, ...]:
    frames = []
    for frame in value or ():
        if isinstance(frame, dict):
            frames.append(Frame(str(frame.get("filename", "?")), _optional_int(frame.get("line")),
                                str(frame.get("name", "?"))))
    return tuple(frames)


def _segment(value: Any) -> Segment:
    s = _dict(value, "a segment")
    address = _int(s["address"], "a segment's address")
    device = _optional_int(s.get("device")) or 0
    blocks = []
    for raw in _list(s.get("blocks", []), "a segment's blocks"):
        b = _dict(raw, "a block")
        blocks.append(Block(device, address, _int(b["address"], "a block's address"), _int(b["size"], "a block's size"),
                            _optional_int(b.get("requested_size")), str(b["state"]), _frames(b.get("frames"))))
    return Segment(device, address, _int(s["total_size"], "a segment's total_size"),
                   _optional_int(s.get("allocated_size")) or 0, _optional_int(s.get("active_size")) or 0,
                   s.get("segment_type"), _optional_int(s.get("stream")), tuple(blocks))


def _trace_entry(device: int, value: Any) -> TraceEntry:
    e = _dict(value, "a trace entry")
    return TraceEntry(device, str(e["action"]), _optional_int(e.get("addr")), _int(e["size"], "a trace entry's size"),
                      _optional_int(e.get("stream")), _optional_int(e.get("time_us")),
                      _optional_int(e.get("device_free")), _frames(e.get("frames")))
