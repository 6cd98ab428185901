"""The shared-memory ring: one mmap'd file per run and rank, written by the engine, drained by the sidecar.

Why a ring and not a socket: writing a fixed-size record into shared memory costs about a
microsecond, never blocks, never raises, and the file outlives the writer, so the last samples
before an OOM kill still reach the store. A reader that falls behind loses the oldest records and
counts the gap; the writer never waits for it.

Byte layout (version 2, little-endian)::

    header, HEADER_SIZE = 4096 bytes
      0   8s   magic            b"MEMWATCH"
      8   u32  version          2 (a reader also reads version 1 rings: see below)
     12   u32  header_size      4096
     16   u32  record_size      128
     20   u32  capacity         number of record slots (a power of two)
     24   u32  writer_pid
     28   u32  rank
     32   u32  world_size
     36   u32  flags            bit 0: the writer closed the ring (clean end)
     40   u64  writer_start     the writer's start time in clock ticks since boot (/proc/PID/stat
                                field 22), so a reader can tell a dead writer from a reused pid
     48   u64  created_ns       wall clock when the ring was created
     56   u64  published        number of records written so far; record n lives in slot n % capacity
     64   u32  meta_len         length of the JSON metadata below
     96   16s  run_id           ASCII, NUL-padded
    112   ...  meta             UTF-8 JSON: engine, model, hostname, device, config (written once)

    record slot i at HEADER_SIZE + i * 128; every record starts with
      0   u64  seq              the record's sequence number (detects a slot overwritten mid-read)
      8   u8   type             1 = sample, 2 = event chunk

    sample (type 1)
      9   u8   flags            bit 0: peak is this step's own (peak was reset after the reading)
     10   u8   phase            phase code (PHASE_CODES; custom phases are announced by phase_start)
     11   u8   step_kind        0 unknown, 1 prefill, 2 decode
     12   u32  (reserved)
     16   i64  step
     24   i64  ts_ns
     32   i64  allocated_bytes, peak_bytes, reserved_bytes, driver_used_bytes, driver_free_bytes
     72   i64  num_tokens
     80   i32  kv_blocks_used, kv_blocks_total, num_seqs
     92   i32  segments         the allocator's segment count                     (version 2 on)
     96   i64  active_bytes, inactive_split_bytes                               (version 2 on)
    112   i32  alloc_retries, num_ooms   the allocator's cumulative counters     (version 2 on)
            (every measured field is -1 when not available)

    Version 1 differs only there: bytes 92..127 of a sample are padding. Its samples drain as
    16-field tuples, version 2 samples as 21-field tuples (:data:`SAMPLE_FIELDS`).

    event chunk (type 2): an event is UTF-8 JSON ``[kind, data]`` cut into chunks of up to 96 bytes,
    written to consecutive slots and published together
      9   u8   flags            bit 0: more chunks of this event follow
     10   u16  length           payload bytes used in this chunk
     12   u32  (reserved)
     16   i64  step
     24   i64  ts_ns
     32   96s  payload

Publication: the writer fills the slot(s), then stores ``published``. A reader copies the slots
between its cursor and ``published``, then reads ``published`` again: slots the writer may have
reused meanwhile are discarded and counted as lost, so a reader never returns a torn record. The
writer may already be filling up to ``MAX_EVENT_CHUNKS`` slots past ``published`` (an event's chunks),
so the reader keeps that margin clear of its window; a copy torn anyway is read again, never taken
for a corrupt ring.

Disk space: the writer reserves the whole file with ``posix_fallocate`` when it creates the ring, so
a full filesystem refuses the ring up front instead of killing the engine with SIGBUS on a later
write. The reader never maps the file: it reads with ``pread``, so a ring truncated under it is
refused (:class:`RingFormatError`), not fatal.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .clean import clean

MAGIC = b"MEMWATCH"
VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER_SIZE = 4096
RECORD_SIZE = 128
DEFAULT_CAPACITY = 1 << 16
META_OFFSET = 112
META_MAX = HEADER_SIZE - META_OFFSET
FLAG_CLOSED = 1

TYPE_SAMPLE = 1
TYPE_EVENT = 2
SAMPLE_PEAK_IS_STEP = 1
CHUNK_MORE = 1
CHUNK_PAYLOAD = 96
MAX_EVENT_CHUNKS = 64
"""An event's JSON is at most this many chunks (6 KiB); the Monitor shortens bigger ones."""
TORN_READ_RETRIES = 4

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,16}$")
STEP_KINDS = (None, "prefill", "decode")
STEP_KIND_CODES = {None: 0, "prefill": 1, "decode": 2}
PHASE_CODES = {None: 0, "load": 1, "warmup": 2, "kv_alloc": 3, "cudagraph": 4, "serve": 5, "shutdown": 6}
FIRST_CUSTOM_PHASE = 16

_HEADER = struct.Struct("<8sIIIIIIIIQQQI28x16s")
_PUBLISHED = struct.Struct("<Q")
_FLAGS = struct.Struct("<I")
_SAMPLE = struct.Struct("<QBBBB4xqqqqqqqqiiiiqqii")
_SAMPLE_SLOT = struct.Struct(_SAMPLE.format + f"{RECORD_SIZE - _SAMPLE.size}x")
_SAMPLE_V1 = struct.Struct("<QBBBB4xqqqqqqqqiii4x")
_SAMPLE_SLOT_V1 = struct.Struct(_SAMPLE_V1.format + f"{RECORD_SIZE - _SAMPLE_V1.size}x")
SAMPLE_FIELDS = (
    "seq", "type", "flags", "phase", "step_kind", "step", "ts_ns", "allocated", "peak", "reserved",
    "driver_used", "driver_free", "num_tokens", "kv_used", "kv_total", "num_seqs",
    "segments", "active", "inactive_split", "alloc_retries", "num_ooms",
)
"""Field order of a drained sample tuple; version 1 samples stop after ``num_seqs``."""
_CHUNK = struct.Struct(f"<QBBH4xqq{CHUNK_PAYLOAD}s")
_PUBLISHED_AT = 56
_FLAGS_AT = 36
assert _HEADER.size == META_OFFSET and _SAMPLE_SLOT.size == RECORD_SIZE and _CHUNK.size == RECORD_SIZE
assert _SAMPLE_SLOT_V1.size == RECORD_SIZE and len(SAMPLE_FIELDS) == len(_SAMPLE.unpack(bytes(_SAMPLE.size)))


class RingFormatError(Exception):
    """The file is not a memwatch ring this version can read."""


class EventTooLarge(ValueError):
    """An event's JSON does not fit in ``MAX_EVENT_CHUNKS`` chunks."""


def process_start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot, or 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


class RingWriter:
    """The engine side: appends records, never blocks and never waits for a reader.

    Not thread-safe on its own; :class:`memwatch_engine.Monitor` serialises calls.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        run_id: str,
        rank: int = 0,
        world_size: int = 1,
        meta: dict[str, Any] | None = None,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if capacity <= 0 or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a power of two, got {capacity}")
        if not RUN_ID_PATTERN.match(run_id):
            raise ValueError(f"run id {run_id!r} must be 1-16 letters, digits, '.', '_' or '-'")
        meta_bytes = json.dumps(meta or {}, separators=(",", ":")).encode()
        if len(meta_bytes) > META_MAX:
            raise ValueError(f"ring metadata is {len(meta_bytes)} bytes; at most {META_MAX} fit")
        self.path = Path(path)
        size = HEADER_SIZE + capacity * RECORD_SIZE
        # Built under a temporary name and linked into place complete, so a reader listing the
        # directory never meets a ring without its header; linking fails if the ring exists.
        building = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            # Take the disk pages now: on a full filesystem this fails here, where the Monitor can turn
            # itself off, instead of a SIGBUS in the engine at the first write to a page with no space.
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            pid = os.getpid()
            _HEADER.pack_into(
                self._map, 0, MAGIC, VERSION, HEADER_SIZE, RECORD_SIZE, capacity, pid, rank, world_size, 0,
                process_start_ticks(pid), _now_ns(), 0, len(meta_bytes), run_id.encode("ascii"),
            )
            self._map[META_OFFSET : META_OFFSET + len(meta_bytes)] = meta_bytes
            os.link(building, self.path)
        finally:
            os.close(fd)
            os.unlink(building)
        self._mask = capacity - 1
        self._seq = 0
        self._pack_sample = _SAMPLE.pack_into
        self._publish_at = slice(_PUBLISHED_AT, _PUBLISHED_AT + 8)

    @property
    def written(self) -> int:
        return self._seq

    def write_sample(
        self, step: int, ts_ns: int, phase: int, step_kind: int, flags: int,
        allocated: int, peak: int, reserved: int, driver_used: int, driver_free: int,
        num_tokens: int, kv_used: int, kv_total: int, num_seqs: int,
        segments: int = -1, active: int = -1, inactive_split: int = -1, alloc_retries: int = -1,
        num_ooms: int = -1,
    ) -> None:
        """Append one sample (the hot path: two ``pack_into`` calls, no allocation beyond arguments)."""
        seq = self._seq
        self._pack_sample(
            self._map, HEADER_SIZE + (seq & self._mask) * RECORD_SIZE, seq, TYPE_SAMPLE, flags, phase,
            step_kind, step, ts_ns, allocated, peak, reserved, driver_used, driver_free, num_tokens,
            kv_used, kv_total, num_seqs, segments, active, inactive_split, alloc_retries, num_ooms,
        )
        self._seq = seq + 1
        # One 8-byte copy: struct's pack_into zero-fills first, so a reader could see the count at 0.
        self._map[self._publish_at] = (seq + 1).to_bytes(8, "little")

    def write_event(self, step: int, ts_ns: int, kind: str, data: dict[str, Any]) -> None:
        """Append one event as JSON chunks, published at once so a reader sees all of it or none."""
        payload = json.dumps([kind, data], separators=(",", ":"), allow_nan=False).encode()
        seq = self._seq
        chunks = [payload[i : i + CHUNK_PAYLOAD] for i in range(0, len(payload), CHUNK_PAYLOAD)] or [b""]
        if len(chunks) > MAX_EVENT_CHUNKS:
            raise EventTooLarge(f"event {kind!r} is {len(payload)} bytes of JSON; at most "
                             f"{MAX_EVENT_CHUNKS * CHUNK_PAYLOAD} fit in the ring")
        for i, chunk in enumerate(chunks):
            more = CHUNK_MORE if i + 1 < len(chunks) else 0
            _CHUNK.pack_into(
                self._map, HEADER_SIZE + ((seq + i) & self._mask) * RECORD_SIZE,
                seq + i, TYPE_EVENT, more, len(chunk), step, ts_ns, chunk,
            )
        self._seq = seq + len(chunks)
        self._map[self._publish_at] = self._seq.to_bytes(8, "little")

    def close(self) -> None:
        """Mark the ring cleanly closed; the file stays for the reader to finish draining."""
        if self._map.closed:
            return
        _FLAGS.pack_into(self._map, _FLAGS_AT, FLAG_CLOSED)
        self._map.flush()
        self._map.close()


@dataclass(frozen=True)
class RingHeader:
    """The fixed part of a ring's header plus its metadata."""

    run_id: str
    rank: int
    world_size: int
    writer_pid: int
    writer_start: int
    capacity: int
    created_ns: int
    meta: dict[str, Any]


@dataclass
class Drained:
    """What one :meth:`RingReader.drain` call returns."""

    samples: list[tuple[Any, ...]]
    """Raw sample tuples in :data:`SAMPLE_FIELDS` order (16 fields from a version 1 ring, 21 after)."""
    events: list[tuple[int, int, int, str, dict[str, Any]]]
    """(seq, step, ts_ns, kind, data) in order; ``seq`` orders events among the samples."""
    bad: list[tuple[int, int, str, bytes]]
    """Records that cannot be taken, set aside: (seq, ts_ns, why, raw bytes)."""
    next_cursor: int
    lost: int
    """Records the writer overwrote before this reader got to them."""


class RingReader:
    """The sidecar (or ``memwatch attach``) side: reads records by sequence number, never writes.

    It reads with ``pread`` rather than a mapping, so a file shrunk under it (truncated by someone,
    a full disk) gives a short read and a :class:`RingFormatError`, never a SIGBUS.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            self.header = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise
        self._capacity = self.header.capacity
        self._mask = self._capacity - 1
        self._size = HEADER_SIZE + self._capacity * RECORD_SIZE
        self.last_published = 0
        """``published`` as the last successful drain read it (saves the caller a read)."""
        # Records the writer may be filling beyond ``published`` (an event's chunks), kept clear of the
        # window a lapped reader copies; at most an eighth of the ring so a small ring still reads.
        self._margin = min(MAX_EVENT_CHUNKS, self._capacity // 8)
        self._phase_names: dict[int, str | None] = {code: name for name, code in PHASE_CODES.items()}

    def _read_header(self) -> RingHeader:
        size = os.fstat(self._fd).st_size
        if size < HEADER_SIZE:
            raise RingFormatError(f"{self.path} is too small to be a memwatch ring ({size} bytes)")
        head = os.pread(self._fd, HEADER_SIZE, 0)
        if len(head) < HEADER_SIZE:
            raise RingFormatError(f"{self.path} is truncated ({len(head)} bytes)")
        fields = _HEADER.unpack_from(head, 0)
        magic, version, header_size, record_size, capacity = fields[:5]
        if magic != MAGIC:
            raise RingFormatError(f"{self.path} is not a memwatch ring (bad magic)")
        if version not in READABLE_VERSIONS or header_size != HEADER_SIZE or record_size != RECORD_SIZE:
            raise RingFormatError(
                f"{self.path} is ring format version {version}; this memwatch reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        self.version = version
        self._slot = _SAMPLE_SLOT if version >= 2 else _SAMPLE_SLOT_V1
        if capacity < 2 or capacity & (capacity - 1) or size < HEADER_SIZE + capacity * RECORD_SIZE:
            raise RingFormatError(f"{self.path} is truncated or has a bad capacity ({capacity})")
        pid, rank, world_size = fields[5:8]
        meta_len = fields[12]
        try:
            meta = json.loads(head[META_OFFSET : META_OFFSET + min(meta_len, META_MAX)] or b"{}")
        except (ValueError, RecursionError) as exc:
            raise RingFormatError(f"{self.path} has unreadable metadata: {exc}") from None
        if not isinstance(meta, dict):
            raise RingFormatError(f"{self.path} has metadata that is not a JSON object")
        meta = clean(meta)  # a writer older or other than the Monitor may have put in what SQLite cannot take
        return RingHeader(
            run_id=fields[13].rstrip(b"\0").decode("ascii", "replace"), rank=rank, world_size=world_size,
            writer_pid=pid, writer_start=fields[9], capacity=capacity, created_ns=fields[10], meta=meta,
        )

    def _pread(self, size: int, offset: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) < size:
            raise RingFormatError(f"{self.path} was truncated while being read (to less than {offset + size} bytes)")
        return data

    @property
    def published(self) -> int:
        return _PUBLISHED.unpack(self._pread(8, _PUBLISHED_AT))[0]

    @property
    def closed(self) -> bool:
        return bool(_FLAGS.unpack(self._pread(4, _FLAGS_AT))[0] & FLAG_CLOSED)

    def intact(self) -> bool:
        """Whether the header still carries the magic (a zeroed or overwritten header does not)."""
        return self._pread(8, 0) == MAGIC

    @property
    def phase_names(self) -> dict[int, str | None]:
        """Phase code -> name; custom codes are learnt from the phase_start events drained so far."""
        return self._phase_names

    def drain(self, cursor: int, limit: int | None = None) -> Drained:
        """Read the records from ``cursor`` up to what is published now (at most ``limit``).

        A copy the writer tore (it lapped this reader while we copied) is read again; if it stays torn
        while the writer runs, nothing is returned and the next call tries again. Only slots that stay
        inconsistent while nothing is written are a corrupt ring.
        """
        size = os.fstat(self._fd).st_size
        if size < self._size:
            raise RingFormatError(f"{self.path} was truncated to {size} bytes (a ring of {self._size})")
        moved = False
        published = cursor
        for _ in range(TORN_READ_RETRIES):
            published = self.published
            if published < cursor:  # a count caught mid-write; only one that stays low is a damaged header
                continue
            drained = self._drain_once(cursor, limit, published)
            if drained is not None:
                self.last_published = published
                return drained
            moved = moved or self.published != published
        if published < cursor:
            raise RingFormatError(f"{self.path}: published count went back from {cursor} to {published}")
        if moved:
            return Drained([], [], [], cursor, 0)
        raise RingFormatError(f"{self.path}: record slots do not hold the sequence numbers they should")

    def _drain_once(self, cursor: int, limit: int | None, published: int) -> Drained | None:
        window = self._capacity - self._margin
        start = max(cursor, published - window)
        end = published if limit is None else min(published, start + limit)
        blob = self._copy(start, end)
        # Anything the writer may have started overwriting while we copied is not trusted.
        after = self.published
        if after < published:  # caught mid-write: read again
            return None
        safe_from = after - window
        if safe_from > start:
            cut = min(safe_from, end)
            blob = blob[(cut - start) * RECORD_SIZE :]
            start = cut
        samples: list[tuple[Any, ...]] = []
        events: list[tuple[int, int, int, str, dict[str, Any]]] = []
        bad: list[tuple[int, int, str, bytes]] = []
        lost = start - cursor
        records = list(self._slot.iter_unpack(blob))
        if not records:
            return Drained(samples, events, bad, start, lost)
        if records[0][0] != start or records[-1][0] != start + len(records) - 1:
            return None
        # The type byte of every record, gathered at C speed: most drains hold no event at all.
        types = blob[8::RECORD_SIZE]
        next_cursor = start + len(records)
        if types.count(TYPE_SAMPLE) == len(types):
            return Drained(records, events, bad, next_cursor, lost)
        pending: list[bytes] = []
        for at, record in enumerate(records):
            kind = types[at]
            if kind == TYPE_SAMPLE:
                if pending:  # an event cut short by a sample: its chunks are set aside
                    bad.append((start + at - len(pending), record[6], "event chunks without an end",
                                blob[(at - len(pending)) * RECORD_SIZE : at * RECORD_SIZE]))
                    pending.clear()
                samples.append(record)
                continue
            if kind != TYPE_EVENT:
                raw = blob[at * RECORD_SIZE : (at + 1) * RECORD_SIZE]
                bad.append((start + at, 0, f"unknown record type {kind}", raw))
                continue
            _, _, more, length, step, ts_ns, payload = _CHUNK.unpack_from(blob, at * RECORD_SIZE)
            pending.append(payload[: min(length, CHUNK_PAYLOAD)])
            if not more:
                seq = start + at + 1 - len(pending)
                raw = b"".join(pending)
                pending.clear()
                event = self._decode_event(raw, seq, step, ts_ns)
                if isinstance(event, str):
                    bad.append((seq, ts_ns, event, raw))
                else:
                    events.append(event)
        if pending:  # an event cut by ``limit`` or still being written: leave it for the next call
            next_cursor = start + len(records) - len(pending)
        return Drained(samples, events, bad, next_cursor, lost)

    def _decode_event(
        self, payload: bytes, seq: int, step: int, ts_ns: int
    ) -> tuple[int, int, int, str, dict[str, Any]] | str:
        """The event, or why it cannot be taken (strict UTF-8 JSON ``[kind, {data}]``, finite numbers)."""
        try:
            decoded = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            return f"undecodable event: {type(exc).__name__}: {str(exc)[:200]}"
        if (not isinstance(decoded, list) or len(decoded) != 2 or not isinstance(decoded[0], str)
                or not isinstance(decoded[1], dict)):
            return "event is not [kind, {data}]"
        kind, data = decoded
        if _has_surrogates(payload, decoded):
            return "event holds text that is not valid Unicode"
        if kind == "phase_start" and isinstance(data.get("code"), int):
            self._phase_names[data["code"]] = data.get("phase") if isinstance(data.get("phase"), str) else None
        return (seq, step, ts_ns, kind, data)

    def _copy(self, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        first = HEADER_SIZE + (start & self._mask) * RECORD_SIZE
        count = end - start
        tail = self._capacity - (start & self._mask)
        if count <= tail:
            return self._pread(count * RECORD_SIZE, first)
        return self._pread(tail * RECORD_SIZE, first) + self._pread((count - tail) * RECORD_SIZE, HEADER_SIZE)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _has_surrogates(payload: bytes, decoded: Any) -> bool:
    """Whether JSON escapes (``\\udcff``) smuggled lone surrogates, which SQLite cannot store, into the text."""
    if b"\\ud" not in payload and b"\\uD" not in payload:
        return False
    try:
        json.dumps(decoded, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _now_ns() -> int:
    import time

    return time.time_ns()
