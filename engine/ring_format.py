"""The ring's format: its byte layout, its constants, and how a record is packed.

Why a module of its own: the engine writes this format (:mod:`.ring`), the sidecar and ``memwatch attach``
read it (:mod:`.ring_reader`), and the store and the detectors read its slots straight from bytes; each of
them needs the layout, and none of them needs the others. What is here is the contract between them and
nothing else: change it and :data:`VERSION` changes with it.

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
    112   ...  meta             UTF-8 JSON: engine, model, hostname, device, config (written once);
                                ``pid_ns`` (the writer's pid namespace inode) and ``writer_lock`` (1: the
                                writer holds a record lock on the file while it lives, see .liveness);
                                ``where``: the container id and Kubernetes names it ran under (.identity)

    record slot i at HEADER_SIZE + i * 128; every record starts with
      0   u64  seq              the record's sequence number (detects a slot overwritten mid-read)
      8   u8   type             1 = sample, 2 = event chunk

    sample (type 1)
      9   u8   flags            bit 0: peak is this step's own (peak was reset after the reading)
                                bit 1: the engine's load is written (bytes 12..15 and 120..127 below)
     10   u8   phase            phase code (PHASE_CODES; custom phases are announced by phase_start)
     11   u8   step_kind        0 unknown, 1 prefill, 2 decode
     12   i32  requests_running requests holding KV that the scheduler runs (with bit 1; else reserved)
     16   i64  step
     24   i64  ts_ns
     32   i64  allocated_bytes, peak_bytes, reserved_bytes, driver_used_bytes, driver_free_bytes
     72   i64  num_tokens
     80   i32  kv_blocks_used, kv_blocks_total, num_seqs
     92   i32  segments         the allocator's segment count                     (version 2 on)
     96   i64  active_bytes, inactive_split_bytes                               (version 2 on)
    112   i32  alloc_retries, num_ooms   the allocator's cumulative counters     (version 2 on)
    120   i32  requests_waiting          requests queued, not yet running          (with bit 1)
    124   i32  kv_blocks_needed          KV blocks the running requests still need to reach their
                                         ``max_tokens``, beyond those they hold    (with bit 1)
            (every measured field is -1 when not available)

    The load (bit 1) came later within version 2: those bytes were padding, which every version 2
    reader skips, so an older sidecar reads a newer engine's samples unchanged; a reader takes the
    load only from a sample whose bit 1 is set (:func:`sample_load`), never from an older writer's zeros.
    Drained tuples leave the load out; it is read from the copied slots, where a reader wants it.

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
"""

from __future__ import annotations

import json
import re
import struct
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
SAMPLE_HAS_LOAD = 2
"""Sample flag: bytes 12..15 and 120..127 hold the engine's load (requests running, waiting, KV blocks needed)."""
CHUNK_MORE = 1
CHUNK_PAYLOAD = 96
MAX_EVENT_CHUNKS = 64
"""An event's JSON is at most this many chunks (6 KiB); the Monitor shortens bigger ones."""
TORN_READ_RETRIES = 4

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,16}\Z")  # \Z: "$" would take a final newline
STEP_KINDS = (None, "prefill", "decode")
STEP_KIND_CODES = {None: 0, "prefill": 1, "decode": 2}
PHASE_CODES = {None: 0, "load": 1, "warmup": 2, "kv_alloc": 3, "cudagraph": 4, "serve": 5, "shutdown": 6}
FIRST_CUSTOM_PHASE = 16

_HEADER = struct.Struct("<8sIIIIIIIIQQQI28x16s")
_PUBLISHED = struct.Struct("<Q")
_FLAGS = struct.Struct("<I")
_SAMPLE = struct.Struct("<QBBBB4xqqqqqqqqiiiiqqii")
_SAMPLE_SLOT = struct.Struct(_SAMPLE.format + f"{RECORD_SIZE - _SAMPLE.size}x")
_SAMPLE_WRITE = struct.Struct("<QBBBBiqqqqqqqqiiiiqqiiii")
"""What a writer packs: the sample with its load (running at 12, waiting and KV blocks needed at 120)."""
_RUNNING = struct.Struct("<i")
_RUNNING_AT = 12
_WAITING_NEEDED = struct.Struct("<ii")
_WAITING_AT = 120
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
PUBLISHED_WORD = _PUBLISHED_AT // 8
_SEQ = struct.Struct("<Q")
_FLAGS_AT = 36
assert _HEADER.size == META_OFFSET and _SAMPLE_SLOT.size == RECORD_SIZE and _CHUNK.size == RECORD_SIZE
assert _SAMPLE_WRITE.size == RECORD_SIZE and _SAMPLE_SLOT_V1.size == RECORD_SIZE
assert len(SAMPLE_FIELDS) == len(_SAMPLE.unpack(bytes(_SAMPLE.size)))


class RingFormatError(Exception):
    """The file is not a memwatch ring this version can read."""


class EventTooLarge(ValueError):
    """An event's JSON does not fit in ``MAX_EVENT_CHUNKS`` chunks."""


def sample_slot(
    step: int, ts_ns: int, phase: int, step_kind: int, flags: int,
    allocated: int, peak: int, reserved: int, driver_used: int, driver_free: int,
    num_tokens: int, kv_used: int, kv_total: int, num_seqs: int,
    segments: int = -1, active: int = -1, inactive_split: int = -1, alloc_retries: int = -1, num_ooms: int = -1,
    requests_running: int = -1, requests_waiting: int = -1, kv_blocks_needed: int = -1,
) -> bytes:
    """One sample record with its load (-1: unknown; flag bit 1 only when some of it is known), its sequence
    number left 0 for the writer to fill."""
    if requests_running != -1 or requests_waiting != -1 or kv_blocks_needed != -1:
        flags |= SAMPLE_HAS_LOAD
    return _SAMPLE_WRITE.pack(
        0, TYPE_SAMPLE, flags, phase, step_kind, requests_running, step, ts_ns, allocated, peak,
        reserved, driver_used, driver_free, num_tokens, kv_used, kv_total, num_seqs, segments, active,
        inactive_split, alloc_retries, num_ooms, requests_waiting, kv_blocks_needed,
    )


def sample_load(slots: bytes, at: int) -> tuple[int, int, int] | None:
    """(requests running, waiting, KV blocks needed) of the sample in slot ``at`` of copied ``slots``; ``None``
    when its writer did not write the load (flag bit 1). Each is -1 where the engine did not say."""
    offset = at * RECORD_SIZE
    if not slots[offset + 9] & SAMPLE_HAS_LOAD:
        return None
    return (_RUNNING.unpack_from(slots, offset + _RUNNING_AT)[0],
            *_WAITING_NEEDED.unpack_from(slots, offset + _WAITING_AT))


def event_slots(step: int, ts_ns: int, kind: str, data: dict[str, Any]) -> list[bytes]:
    """One event's records: its JSON cut into chunks (:class:`EventTooLarge` past :data:`MAX_EVENT_CHUNKS`)."""
    payload = json.dumps([kind, data], separators=(",", ":"), allow_nan=False).encode()
    chunks = [payload[i : i + CHUNK_PAYLOAD] for i in range(0, len(payload), CHUNK_PAYLOAD)] or [b""]
    if len(chunks) > MAX_EVENT_CHUNKS:
        raise EventTooLarge(f"event {kind!r} is {len(payload)} bytes of JSON; at most "
                            f"{MAX_EVENT_CHUNKS * CHUNK_PAYLOAD} fit in the ring")
    last = len(chunks) - 1
    return [_CHUNK.pack(0, TYPE_EVENT, CHUNK_MORE if i < last else 0, len(chunk), step, ts_ns, chunk)
            for i, chunk in enumerate(chunks)]
