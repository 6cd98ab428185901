"""Reading a ring: the sidecar's and ``memwatch attach``'s side of the format :mod:`.ring_format` defines.

It never maps the file: it reads with ``pread``, so a ring truncated under it is refused
(:class:`RingFormatError`), never a SIGBUS; and it keeps clear of the slots the writer may still be
filling, retrying a copy torn anyway (the rules are in :mod:`.ring_format`'s docstring).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .clean import clean
from .ring_format import (
    _CHUNK,
    _FLAGS,
    _FLAGS_AT,
    _HEADER,
    _PUBLISHED,
    _PUBLISHED_AT,
    _SAMPLE_SLOT,
    _SAMPLE_SLOT_V1,
    CHUNK_PAYLOAD,
    FLAG_CLOSED,
    HEADER_SIZE,
    MAGIC,
    MAX_EVENT_CHUNKS,
    META_MAX,
    META_OFFSET,
    PHASE_CODES,
    READABLE_VERSIONS,
    RECORD_SIZE,
    TORN_READ_RETRIES,
    TYPE_EVENT,
    TYPE_SAMPLE,
    RingFormatError,
)


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
    owner_uid: int | None = None
    """The uid owning the ring file, from ``fstat`` of the reader's open descriptor: the writer's uid,
    which a path the ring names (a snapshot) must belong to as well."""

_NOT_SAMPLE = re.compile(b"[^" + re.escape(bytes([TYPE_SAMPLE])) + b"]")
"""Matches the type byte of any record that is not a sample (an event chunk, or a type this reader does not know)."""


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
    slots: bytes = b""
    """The copied slots the samples were unpacked from (events' too, 128 bytes each; empty when nothing was
    read): the samples are its slots of type 1, in order, for a reader that views them as columns."""


class RingReader:
    """The sidecar (or ``memwatch attach``) side: reads records by sequence number, never writes.

    It reads with ``pread`` rather than a mapping, so a file shrunk under it (truncated by someone,
    a full disk) gives a short read and a :class:`RingFormatError`, never a SIGBUS.
    """

    def __init__(self, path: str | os.PathLike[str], fd: int | None = None) -> None:
        """Open ``path``, or take ``fd`` (already opened, judged by the caller; the reader owns it now).

        A ring in a directory another uid can write is opened by the caller through the directory's
        descriptor (:mod:`.dirfd`), so no path is looked up again here.
        """
        self.path = Path(path)
        self._fd = -1
        self._fd = fd if fd is not None else os.open(
            self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
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
        info = os.fstat(self._fd)
        if not stat.S_ISREG(info.st_mode):
            raise RingFormatError(f"{self.path} is not a regular file")
        size = info.st_size
        if size < HEADER_SIZE:
            raise RingFormatError(f"{self.path} is too small to be a memwatch ring ({size} bytes)")
        head = os.pread(self._fd, HEADER_SIZE, 0)
        if len(head) < HEADER_SIZE:
            raise RingFormatError(f"{self.path} is truncated ({len(head)} bytes)")
        fields = _HEADER.unpack_from(head, 0)
        magic, version, header_size, record_size, capacity = fields[:5]
        if magic != MAGIC:
            raise RingFormatError(f"{self.path} is not a memwatch ring (bad magic)")
        if version not in READABLE_VERSIONS:
            raise RingFormatError(
                f"{self.path} is ring format version {version}; this memwatch reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        if header_size != HEADER_SIZE or record_size != RECORD_SIZE:
            raise RingFormatError(
                f"{self.path} has a bad header: header size {header_size} and record size {record_size} "
                f"(format version {version} has {HEADER_SIZE} and {RECORD_SIZE})"
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
            owner_uid=info.st_uid,
        )

    def _pread(self, size: int, offset: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) < size:
            raise RingFormatError(f"{self.path} was truncated while being read (to less than {offset + size} bytes)")
        return data

    def fileno(self) -> int:
        """The reader's own open of the ring (asked for the writer's lock: :mod:`.liveness`)."""
        return self._fd

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
            return Drained(records, events, bad, next_cursor, lost, blob)
        pending: list[bytes] = []
        taken = 0  # records before this index are handled
        # Only the records that are not samples are visited one by one (found at C speed); the samples
        # between them are taken as slices.
        for match in _NOT_SAMPLE.finditer(types):
            at = match.start()
            if at > taken:
                if pending:  # an event cut short by a sample: its chunks are set aside
                    bad.append((start + taken - len(pending), records[taken][6], "event chunks without an end",
                                blob[(taken - len(pending)) * RECORD_SIZE : taken * RECORD_SIZE]))
                    pending.clear()
                samples += records[taken:at]
            taken = at + 1
            kind = types[at]
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
        if taken < len(records):
            if pending:
                bad.append((start + taken - len(pending), records[taken][6], "event chunks without an end",
                            blob[(taken - len(pending)) * RECORD_SIZE : taken * RECORD_SIZE]))
                pending.clear()
            samples += records[taken:]
        if pending:  # an event cut by ``limit`` or still being written: leave it for the next call
            next_cursor = start + len(records) - len(pending)
        return Drained(samples, events, bad, next_cursor, lost, blob)

    def _decode_event(
        self, payload: bytes, seq: int, step: int, ts_ns: int
    ) -> tuple[int, int, int, str, dict[str, Any]] | str:
        """The event, or why it cannot be taken (strict UTF-8 JSON ``[kind, {data}]``, finite numbers)."""
        try:
            decoded = _decode_json(payload.decode("utf-8"))
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


def _finite_float(text: str) -> float:
    """A JSON number as a float, refused when it overflows to infinity (``1e999``)."""
    value = float(text)
    if value in (_INF, -_INF):
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


_INF = float("inf")
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def _decode_json(text: str) -> Any:
    """``json.loads`` with the finite-number rules, through one decoder built once rather than one per event."""
    if text.startswith("\ufeff"):  # json.loads refuses a byte-order mark before decoding: so do we, alike
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    return _DECODER.decode(text)


def _has_surrogates(payload: bytes, decoded: Any) -> bool:
    """Whether JSON escapes (``\\udcff``) smuggled lone surrogates, which SQLite cannot store, into the text."""
    if b"\\ud" not in payload and b"\\uD" not in payload:
        return False
    try:
        json.dumps(decoded, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
