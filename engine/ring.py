"""The shared-memory ring: one mmap'd file per run and rank, written by the engine, drained by the sidecar.

Why a ring and not a socket: writing a fixed-size record into shared memory costs about a
microsecond, never blocks, never raises, and the file outlives the writer, so the last samples
before an OOM kill still reach the store. A reader that falls behind loses the oldest records and
counts the gap; the writer never waits for it.

Writers in one process: threads share a ring without a lock. A writer pops the ring's cursor (the next
sequence number), writes and appends the moved cursor; one that finds it gone queues its records for the
holder to write next, so no writer ever waits (:meth:`RingWriter._write`). A queued record follows the one
written while it waited (or, where a step held the ring, by the next write), so its time can be a little
before its predecessor's. A forked child
never writes its parent's ring: its copies of the writers refuse (a Monitor there turns itself off).

Disk space: the writer reserves the whole file with ``posix_fallocate`` when it creates the ring, so
a full filesystem refuses the ring up front instead of killing the engine with SIGBUS on a later
write. The reader never maps the file: it reads with ``pread``, so a ring truncated under it is
refused (:class:`RingFormatError`), not fatal.

The format (the byte layout, the constants, how a record is packed) is :mod:`.ring_format`; this module
writes it and :mod:`.ring_reader` reads it. The format's public names are re-exported here, where the
rest of memwatch imports them from.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, NamedTuple

from .liveness import pid_namespace, process_start_ticks, release_writer_lock, take_writer_lock
from .ring_format import (
    _FLAGS,
    _FLAGS_AT,
    _HEADER,
    _SEQ,
    CHUNK_MORE,
    CHUNK_PAYLOAD,
    DEFAULT_CAPACITY,
    FIRST_CUSTOM_PHASE,
    FLAG_CLOSED,
    HEADER_SIZE,
    MAGIC,
    MAX_EVENT_CHUNKS,
    META_MAX,
    META_OFFSET,
    PHASE_CODES,
    PUBLISHED_WORD,
    READABLE_VERSIONS,
    RECORD_SIZE,
    RUN_ID_PATTERN,
    SAMPLE_FIELDS,
    SAMPLE_PEAK_IS_STEP,
    STEP_KIND_CODES,
    STEP_KINDS,
    TORN_READ_RETRIES,
    TYPE_EVENT,
    TYPE_SAMPLE,
    VERSION,
    EventTooLarge,
    RingFormatError,
    event_slots,
    sample_slot,
)

__all__ = [
    "CHUNK_MORE", "CHUNK_PAYLOAD", "CLOSE_WAIT_S", "DEFAULT_CAPACITY", "FIRST_CUSTOM_PHASE", "FLAG_CLOSED",
    "HEADER_SIZE", "MAGIC", "MAX_EVENT_CHUNKS", "META_MAX", "META_OFFSET", "PHASE_CODES", "PUBLISHED_WORD",
    "READABLE_VERSIONS", "RECORD_SIZE", "RUN_ID_PATTERN", "SAMPLE_FIELDS", "SAMPLE_PEAK_IS_STEP", "STEP_KINDS",
    "STEP_KIND_CODES", "TORN_READ_RETRIES", "TYPE_EVENT", "TYPE_SAMPLE", "VERSION", "EventTooLarge",
    "RingFormatError", "RingSlots", "RingWriter", "event_slots", "sample_slot",
]


CLOSE_WAIT_S = 0.5
"""How long closing waits for a write in another thread to finish."""


class RingWriter:
    """The engine side: appends records, never blocks and never waits for a reader or another writer.

    Safe to call from several threads at once (the cursor is popped, see :meth:`_write`).
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
        mode: int = 0o600,
    ) -> None:
        if capacity <= 0 or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a power of two, got {capacity}")
        if sys.byteorder != "little":
            raise ValueError("rings are written on little-endian hosts only")
        if not RUN_ID_PATTERN.match(run_id):
            raise ValueError(f"run id {run_id!r} must be 1-16 letters, digits, '.', '_' or '-'")
        # How a reader tells this writer is alive: its lock on the ring, and its pid namespace (see .liveness).
        meta = {**(meta or {}), "pid_ns": pid_namespace(), "writer_lock": 1}
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
        if len(meta_bytes) > META_MAX:
            raise ValueError(f"ring metadata is {len(meta_bytes)} bytes; at most {META_MAX} fit")
        self.path = Path(path)
        size = HEADER_SIZE + capacity * RECORD_SIZE
        # Built under a temporary name and linked into place complete, so a reader listing the
        # directory never meets a ring without its header; linking fails if the ring exists.
        building = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        # One descriptor for everything: the process's record lock on the ring goes with the first close of ANY
        # descriptor of the file in this process (.liveness), so the file is opened once and this descriptor
        # stays open, holding the lock, until close(). (The mapping keeps a duplicate of it, closed with the map.)
        fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._lock_fd: int | None = None
        keep = False
        try:
            os.fchmod(fd, mode)  # exactly this mode, whatever the umask (0640 in a shared group directory)
            os.ftruncate(fd, size)
            # Take the disk pages now: on a full filesystem this fails here, where the Monitor can turn
            # itself off, instead of a SIGBUS in the engine at the first write to a page with no space.
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if take_writer_lock(fd):
                self._lock_fd = fd
            else:
                del meta["writer_lock"]  # a reader falls back to the pid, where it can see it
                meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
            pid = os.getpid()
            _HEADER.pack_into(
                self._map, 0, MAGIC, VERSION, HEADER_SIZE, RECORD_SIZE, capacity, pid, rank, world_size, 0,
                process_start_ticks(pid), time.time_ns(), 0, len(meta_bytes), run_id.encode("ascii"),
            )
            self._map[META_OFFSET : META_OFFSET + len(meta_bytes)] = meta_bytes
            os.link(building, self.path)
            keep = self._lock_fd is not None
        finally:
            if not keep:  # refused, or no lock to hold: the descriptor goes now (the mapping has its own)
                self._lock_fd = None
                release_writer_lock(fd)
                os.close(fd)
            os.unlink(building)
        self._mask = capacity - 1
        self._cursor = [0]
        """The next record's sequence number, and the right to write: whoever pops it writes, and appends the
        next one when done (:meth:`_write`). A list, so the Monitor's step (:mod:`.stepper`) shares it."""
        self._waiting: deque[list[bytes]] = deque()
        """Records that found the ring busy, written next by whoever holds it."""
        # The header's ``published`` counter as an aligned 8-byte word: one store (struct's pack_into zero-fills
        # first, so a reader could see the count at 0). The word is in native order, the ring's own on the
        # little-endian hosts memwatch runs on (checked above).
        self._published = memoryview(self._map).cast("Q")
        self._orphaned = False
        _WRITERS.add(self)

    def _orphan(self) -> None:
        """In a forked child: this process never writes the ring (its parent does), whatever it was doing."""
        self._orphaned = True
        self._cursor.clear()  # a claim fails: the Monitor's step takes its slow path, which refuses
        self._waiting.clear()

    @property
    def written(self) -> int:
        """Records written so far (while another thread writes, those published so far)."""
        cursor = self._cursor
        if cursor:
            return cursor[0]
        return self._closed_at if self._map.closed else self._published[PUBLISHED_WORD]

    def write_sample(self, *fields: int) -> None:
        """Append one sample, fields as :func:`sample_slot` takes them (the Monitor's step packs its own straight
        into the slot: :mod:`.stepper`)."""
        self._write([sample_slot(*fields)])

    def write_event(self, step: int, ts_ns: int, kind: str, data: dict[str, Any]) -> None:
        """Append one event as JSON chunks, published at once so a reader sees all of it or none."""
        self._write(event_slots(step, ts_ns, kind, data))

    def write_slots(self, records: list[bytes]) -> None:
        """Append whole records made by :func:`sample_slot` or :func:`event_slots` (kept before the ring existed)."""
        self._write(records)

    def hot_path(self) -> RingSlots:
        """What a writer that packs its own records needs: the map, the cursor, ``published`` and the queue."""
        return RingSlots(self._map, self._mask, self._cursor, self._published, self._waiting)

    def _write(self, records: list[bytes]) -> None:
        """Write ``records`` (whole slots, their sequence numbers left 0) in consecutive slots, published at once.

        A lock without a wait: the writer pops the cursor, writes, and appends the cursor it moved on; popping
        is atomic, so two writers never share a slot. A writer that finds the cursor gone — another thread
        writing, or this thread's own write interrupted by a signal handler that writes too — leaves its
        records in the waiting queue and returns, and whoever holds the cursor writes them before giving it
        back. Nobody ever waits, so nothing can deadlock.
        """
        if self._map.closed or self._orphaned:
            raise ValueError(f"the ring {self.path} is closed" if not self._orphaned else
                             f"the ring {self.path} is written by the process that created it, not a forked child")
        cursor = self._cursor
        try:
            seq = cursor.pop()
        except IndexError:
            self._waiting.append(records)
            self.write_waiting()  # the holder may have given the cursor back before the append
            return
        try:
            seq = self._put(self._put_waiting(seq), records)  # what queued before this claim goes first: in order
        finally:
            cursor.append(seq)
        if self._waiting:
            self.write_waiting()

    def write_waiting(self) -> None:
        """Write the records that found the ring busy, unless another writer holds it (it writes them then).

        This writer's methods call it after they give the cursor back, and a writer that queues records calls it
        after queueing them, so a queued record is written by one of the two, or, behind the Monitor's step
        (which does not look again), by the next write: every write writes the queue before its own records.
        """
        cursor, waiting = self._cursor, self._waiting
        while waiting:
            try:
                seq = cursor.pop()
            except IndexError:
                return
            try:
                seq = self._put_waiting(seq)
            finally:
                cursor.append(seq)

    def _put(self, seq: int, records: list[bytes]) -> int:
        """Copy ``records`` into the slots from ``seq`` on, each with its sequence number, and publish them;
        the next sequence number. The caller holds the cursor."""
        ring, mask = self._map, self._mask
        for i, record in enumerate(records):
            at = HEADER_SIZE + ((seq + i) & mask) * RECORD_SIZE
            ring[at : at + RECORD_SIZE] = record
            _SEQ.pack_into(ring, at, seq + i)
        seq += len(records)
        self._published[PUBLISHED_WORD] = seq
        return seq

    def _put_waiting(self, seq: int) -> int:
        """:meth:`_put` of every queued record, oldest first; the next sequence number. The caller holds the cursor."""
        while self._waiting:
            seq = self._put(seq, self._waiting.popleft())
        return seq

    def close(self) -> None:
        """Mark the ring cleanly closed; the file stays for the reader to finish draining.

        It takes the cursor from a writer in another thread (waiting at most :data:`CLOSE_WAIT_S`) and keeps it:
        a write after this raises.
        """
        if self._map.closed:
            return
        if self._orphaned:  # a forked child lets go of its copy of the mapping; the ring stays its parent's
            self._closed_at = self._published[PUBLISHED_WORD]
            self._published.release()
            self._map.close()
            self._drop_lock()
            return
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not self._cursor and time.monotonic() < deadline:
            time.sleep(0.001)
        try:
            seq = self._put_waiting(self._cursor.pop())
        except IndexError:  # held past the wait by this thread's own interrupted write: that write fails, harmlessly
            seq = self._published[PUBLISHED_WORD]
        self._closed_at = seq
        _FLAGS.pack_into(self._map, _FLAGS_AT, FLAG_CLOSED)
        self._map.flush()
        self._published.release()  # an mmap with a view on it cannot close
        self._map.close()
        self._drop_lock()

    def _drop_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None and release_writer_lock(fd):
            try:
                os.close(fd)
            except OSError:
                pass


_WRITERS: weakref.WeakSet[RingWriter] = weakref.WeakSet()
"""The writers of this process, orphaned in a forked child: two processes writing one ring would corrupt it."""


def _orphan_in_child() -> None:
    for writer in list(_WRITERS):
        writer._orphan()


os.register_at_fork(after_in_child=_orphan_in_child)


class RingSlots(NamedTuple):
    """A ring writer's state for code that packs records straight into its slots (the Monitor's step).

    Such a writer pops ``cursor`` (an ``IndexError`` means the ring is busy; records in ``waiting`` mean they
    go first: in either case it writes through :meth:`RingWriter.write_sample` instead), packs record ``seq``
    into slot ``seq & mask``, stores ``seq + 1`` in ``published[PUBLISHED_WORD]`` and appends ``seq + 1`` to
    ``cursor``. What was queued meanwhile is written by the next write.
    """

    ring: mmap.mmap
    mask: int
    cursor: list[int]
    published: memoryview
    waiting: deque[list[bytes]]
