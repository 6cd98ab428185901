"""The ring's byte format, publication and loss accounting, with real files and mmap."""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

import pytest

from memwatch_engine.ring import HEADER_SIZE, RECORD_SIZE, RingFormatError, RingWriter
from memwatch_engine.ring_reader import RingReader


def _writer(path: Path, capacity: int = 64, **meta: object) -> RingWriter:
    return RingWriter(path, run_id="r1", rank=1, world_size=2, meta=dict(meta) or {"engine": "x"}, capacity=capacity)


def _sample(writer: RingWriter, step: int) -> None:
    writer.write_sample(step, 1000 + step, 5, 2, 1, 10 * step, 11 * step, 12 * step, 13 * step, -1, 7, 3, 64, 2)


def test_header_and_file_mode(tmp_path: Path) -> None:
    path = tmp_path / "a.ring"
    _writer(path, capacity=64, engine="nano-vllm", model="Qwen")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.path.getsize(path) == HEADER_SIZE + 64 * RECORD_SIZE
    header = RingReader(path).header
    assert (header.run_id, header.rank, header.world_size, header.capacity) == ("r1", 1, 2, 64)
    assert header.writer_pid == os.getpid()
    own_ns = os.stat("/proc/self/ns/pid").st_ino
    assert header.meta == {"engine": "nano-vllm", "model": "Qwen", "pid_ns": own_ns, "writer_lock": 1}
    assert header.writer_start > 0


def test_samples_round_trip_in_order(tmp_path: Path) -> None:
    path = tmp_path / "a.ring"
    writer = _writer(path)
    for step in range(1, 41):
        _sample(writer, step)
    drained = RingReader(path).drain(0)
    assert drained.lost == 0 and drained.next_cursor == 40 and drained.events == []
    seqs = [s[0] for s in drained.samples]
    assert seqs == list(range(40))
    # (seq, type, flags, phase, kind, step, ts, alloc, peak, reserved, used, free, tokens, kv_used, kv_total, seqs,
    #  segments, active, inactive_split, alloc_retries, num_ooms)
    assert drained.samples[2] == (2, 1, 1, 5, 2, 3, 1003, 30, 33, 36, 39, -1, 7, 3, 64, 2, -1, -1, -1, -1, -1)


def test_events_are_chunked_and_reassembled(tmp_path: Path) -> None:
    path = tmp_path / "a.ring"
    writer = _writer(path)
    _sample(writer, 1)
    data = {"phase": "x" * 300, "code": 17}
    writer.write_event(1, 2000, "phase_start", data)
    _sample(writer, 2)
    reader = RingReader(path)
    drained = reader.drain(0)
    payload = len(json.dumps(["phase_start", data], separators=(",", ":")))
    assert payload == 338
    assert writer.written == 2 + 4  # 338 bytes of JSON take ceil(338 / 96) = 4 chunks
    assert [(seq, step, ts, kind) for seq, step, ts, kind, _ in drained.events] == [(1, 1, 2000, "phase_start")]
    assert drained.events[0][4] == data
    assert reader.phase_names[17] == "x" * 300
    assert [s[5] for s in drained.samples] == [1, 2]


def test_reader_resumes_from_cursor_and_counts_overwritten_records(tmp_path: Path) -> None:
    path = tmp_path / "a.ring"
    writer = _writer(path, capacity=16)
    reader = RingReader(path)
    for step in range(10):
        _sample(writer, step)
    first = reader.drain(0, limit=4)
    assert first.next_cursor == 4 and len(first.samples) == 4
    for step in range(10, 40):
        _sample(writer, step)
    second = reader.drain(first.next_cursor)
    # 40 written in 16 slots, of which 16 / 8 = 2 are kept clear for records the writer may have in
    # flight: records 26..39 are read, 4..25 counted lost.
    assert second.lost == 22
    assert [s[0] for s in second.samples] == list(range(26, 40))


def test_close_sets_flag(tmp_path: Path) -> None:
    path = tmp_path / "a.ring"
    writer = _writer(path)
    reader = RingReader(path)
    assert not reader.closed
    writer.close()
    assert reader.closed


def test_rejects_foreign_and_truncated_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.ring"
    junk.write_bytes(b"\0" * (HEADER_SIZE + RECORD_SIZE))
    with pytest.raises(RingFormatError, match="not a memwatch ring"):
        RingReader(junk)
    short = tmp_path / "short.ring"
    short.write_bytes(b"MEMWATCH")
    with pytest.raises(RingFormatError, match="too small"):
        RingReader(short)
    newer = tmp_path / "newer.ring"
    _writer(newer)
    with open(newer, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 99))
    with pytest.raises(RingFormatError, match="version 99"):
        RingReader(newer)


def test_capacity_must_be_power_of_two(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="power of two"):
        RingWriter(tmp_path / "x.ring", run_id="r", capacity=100)


def test_refuses_to_overwrite_existing_ring(tmp_path: Path) -> None:
    path = tmp_path / "a.ring"
    _writer(path)
    with pytest.raises(FileExistsError):
        _writer(path)
