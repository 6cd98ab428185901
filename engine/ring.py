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
reused meanwhile are discarded and counted as lost, so a reader never returns a torn record.
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
        self._pack_published = _PUBLISHED.pack_into

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
        self._pack_published(self._map, _PUBLISHED_AT, seq + 1)

    def write_event(self, step: int, ts_ns: int, kind: str, data: dict[str, Any]) -> None:
        """Append one event as JSON chunks, published at once so a reader sees all of it or none."""
        payload = json.dumps([kind, data], separators=(",", ":")).encode()
        seq = self._seq
        chunks = [payload[i : i + CHUNK_PAYLOAD] for i in range(0, len(payload), CHUNK_PAYLOAD)] or [b""]
        for i, chunk in enumerate(chunks):
            more = CHUNK_MORE if i + 1 < len(chunks) else 0
            _CHUNK.pack_into(
                self._map, HEADER_SIZE + ((seq + i) & self._mask) * RECORD_SIZE,
                seq + i, TYPE_EVENT, more, len(chunk), step, ts_ns, chunk,
            )
        self._seq = seq + len(chunks)
        self._pack_published(self._map, _PUBLISHED_AT, self._seq)

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
    next_cursor: int
    lost: int
    """Records the writer overwrote before this reader got to them."""


class RingReader:
    """The sidecar (or ``memwatch attach``) side: reads records by sequence number, never writes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise RingFormatError(f"{self.path} is too small to be a memwatch ring ({size} bytes)")
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        fields = _HEADER.unpack_from(self._map, 0)
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
        if size < HEADER_SIZE + capacity * RECORD_SIZE or capacity & (capacity - 1):
            raise RingFormatError(f"{self.path} is truncated or has a bad capacity ({capacity})")
        pid, rank, world_size = fields[5:8]
        meta_len = fields[12]
        try:
            meta = json.loads(bytes(self._map[META_OFFSET : META_OFFSET + min(meta_len, META_MAX)]) or b"{}")
        except ValueError as exc:
            raise RingFormatError(f"{self.path} has unreadable metadata: {exc}") from None
        self.header = RingHeader(
            run_id=fields[13].rstrip(b"\0").decode("ascii", "replace"), rank=rank, world_size=world_size,
            writer_pid=pid, writer_start=fields[9], capacity=capacity, created_ns=fields[10], meta=meta,
        )
        self._capacity = capacity
        self._mask = capacity - 1
        self._phase_names: dict[int, str | None] = {code: name for name, code in PHASE_CODES.items()}

    @property
    def published(self) -> int:
        return _PUBLISHED.unpack_from(self._map, _PUBLISHED_AT)[0]

    @property
    def closed(self) -> bool:
        return bool(_FLAGS.unpack_from(self._map, _FLAGS_AT)[0] & FLAG_CLOSED)

    @property
    def phase_names(self) -> dict[int, str | None]:
        """Phase code -> name; custom codes are learnt from the phase_start events drained so far."""
        return self._phase_names

    def drain(self, cursor: int, limit: int | None = None) -> Drained:
        """Read the records from ``cursor`` up to what is published now (at most ``limit``)."""
        published = self.published
        start = max(cursor, published - self._capacity)
        end = published if limit is None else min(published, start + limit)
        blob = self._copy(start, end)
        # Anything the writer may have started overwriting while we copied is not trusted.
        safe_from = self.published - self._capacity
        if safe_from > start:
            cut = min(safe_from, end)
            blob = blob[(cut - start) * RECORD_SIZE :]
            start = cut
        samples: list[tuple[Any, ...]] = []
        events: list[tuple[int, int, int, str, dict[str, Any]]] = []
        lost = start - cursor
        records = list(self._slot.iter_unpack(blob))
        if not records:
            return Drained(samples, events, start, lost)
        if records[0][0] != start or records[-1][0] != start + len(records) - 1:
            raise RingFormatError(f"{self.path}: slots hold records {records[0][0]}..{records[-1][0]}, "
                                  f"expected {start}..{start + len(records) - 1}")
        # The type byte of every record, gathered at C speed: most drains hold no event at all.
        types = blob[8::RECORD_SIZE]
        event_type = bytes([TYPE_EVENT])
        next_cursor = start + len(records)
        pending: list[bytes] = []
        done = 0
        at = types.find(event_type)
        while at != -1:
            samples.extend(records[done:at])
            _, _, more, length, step, ts_ns, payload = _CHUNK.unpack_from(blob, at * RECORD_SIZE)
            pending.append(payload[:length])
            if not more:
                event = self._decode_event(b"".join(pending), start + at + 1 - len(pending), step, ts_ns)
                pending.clear()
                if event is not None:
                    events.append(event)
            done = at + 1
            at = types.find(event_type, done)
        samples.extend(records[done:])
        if pending:  # an event cut by ``limit``: leave it for the next call
            next_cursor = start + done - len(pending)
        return Drained(samples, events, next_cursor, lost)

    def _decode_event(
        self, payload: bytes, seq: int, step: int, ts_ns: int
    ) -> tuple[int, int, int, str, dict[str, Any]] | None:
        try:
            kind, data = json.loads(payload)
        except ValueError:
            return None
        if kind == "phase_start" and isinstance(data.get("code"), int):
            self._phase_names[data["code"]] = data.get("phase")
        return (seq, step, ts_ns, str(kind), data if isinstance(data, dict) else {"value": data})

    def _copy(self, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        first = HEADER_SIZE + (start & self._mask) * RECORD_SIZE
        count = end - start
        tail = self._capacity - (start & self._mask)
        if count <= tail:
            return self._map[first : first + count * RECORD_SIZE]
        return self._map[first:] + self._map[HEADER_SIZE : HEADER_SIZE + (count - tail) * RECORD_SIZE]

    def close(self) -> None:
        self._map.close()


def _now_ns() -> int:
    import time

    return time.time_ns()
