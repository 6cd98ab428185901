"""One bad record never stops the sidecar: the Monitor cleans what it writes, the collector sets aside
what it still cannot take (with its bytes) and moves on; the other rings keep flowing."""

from __future__ import annotations

import json
import math
import os
import sqlite3
from pathlib import Path

from memwatch.sidecar.collector import Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_format import _CHUNK, CHUNK_PAYLOAD, HEADER_SIZE, RECORD_SIZE

from probes import ScriptedProbe
from stored_runs import drain


def _store(runtime_dir: Path, db_path: Path) -> tuple[Collector, StoreWriter]:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: False)
    collector.scan()
    drain(collector)
    assert writer.flush(timeout=30) and writer.error is None, writer.error
    return collector, writer


def _rows(db_path: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with sqlite3.connect(db_path) as conn:
        return conn.execute(sql, params).fetchall()


def test_hostile_values_through_the_public_api_are_stored_cleaned(runtime_dir: Path, db_path: Path) -> None:
    model = os.fsdecode(b"/models/qwen-\xff\xfe")  # a path that is not UTF-8: lone surrogates in a str
    monitor = Monitor(engine="e", model=model, probe=ScriptedProbe(), runtime_dir=runtime_dir, run_id="hostile",
                      spawn_sidecar=False, config={"util": math.inf})
    with monitor.phase(os.fsdecode(b"phase-\xff")):
        monitor.step("decode")
    monitor.kv_allocated(100, 4096, gpu_memory_utilization=math.inf, total_bytes=10_000)
    monitor.event("custom", [1, 2, 3])  # not a JSON object
    monitor.event("nan", {"x": math.nan, "deep": json.loads("[" * 40 + "]" * 40)})
    monitor.set_config(block_size=16, ratio=-math.inf)
    monitor.close()
    assert monitor.enabled is False  # closed, not turned off by an error
    collector, _writer = _store(runtime_dir, db_path)
    assert _rows(db_path, "SELECT model, status FROM runs") == [("/models/qwen-\ufffd\ufffd", "ok")]
    kv = json.loads(_rows(db_path, "SELECT data FROM events WHERE kind = 'kv_allocated'")[0][0])
    assert kv["gpu_memory_utilization"] is None and kv["num_blocks"] == 100
    assert json.loads(_rows(db_path, "SELECT data FROM events WHERE kind = 'custom'")[0][0]) == {"value": [1, 2, 3]}
    # A config event is a JSON merge patch: the cleaned -inf (null) removes its key.
    assert json.loads(_rows(db_path, "SELECT config FROM runs")[0][0]) == {"util": None, "block_size": 16}
    assert _rows(db_path, "SELECT count(*) FROM samples WHERE phase = 'phase-\ufffd'") == [(3,)]
    assert collector.set_aside_total == 0 and not list(runtime_dir.glob("*.ring"))


def _raw_event(writer: RingWriter, payload: bytes) -> None:
    """An event written byte for byte, as a foreign or buggy writer would (no validation)."""
    seq = writer.written
    chunks = [payload[i : i + CHUNK_PAYLOAD] for i in range(0, len(payload), CHUNK_PAYLOAD)]
    for i, chunk in enumerate(chunks):
        _CHUNK.pack_into(writer._map, HEADER_SIZE + ((seq + i) & writer._mask) * RECORD_SIZE, seq + i, 2,
                         int(i + 1 < len(chunks)), len(chunk), 1, 5, chunk)
    writer._cursor[0] = end = seq + len(chunks)
    writer._map[56:64] = end.to_bytes(8, "little")


def test_undecodable_records_are_set_aside_with_their_bytes_and_the_rest_flows(runtime_dir: Path,
                                                                                 db_path: Path) -> None:
    bad = RingWriter(runtime_dir / "bad-r0.ring", run_id="bad", meta={"engine": "raw"}, capacity=64)
    good = RingWriter(runtime_dir / "good-r0.ring", run_id="good", meta={"engine": "raw"}, capacity=64)
    hostile = [b'["x", {"a": 1', b'\xff\xfe not utf-8', b'["x", [1, 2]]', b'["x", {"v": NaN}]',
               b'["x", {"s": "\\udcff"}]', b"[" * 5000 + b"]" * 5000]
    for step in range(3):
        bad.write_sample(step, 10 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        good.write_sample(step, 10 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    for payload in hostile[:5]:
        _raw_event(bad, payload)
    bad.write_sample(3, 20, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    bad.write_event(3, 21, "ok", {"fine": True})
    for writer in (bad, good):
        writer.close()
    collector, writer = _store(runtime_dir, db_path)
    assert collector.set_aside_total == 5
    assert _rows(db_path, "SELECT count(*) FROM samples WHERE run_id = 'bad'") == [(4,)]
    assert _rows(db_path, "SELECT count(*) FROM samples WHERE run_id = 'good'") == [(3,)]
    assert _rows(db_path, "SELECT kind FROM events WHERE run_id = 'bad'") == [("ok",)]
    aside = _rows(db_path, "SELECT run_id, rank, seq, raw, reason FROM set_aside ORDER BY seq")
    assert [row[:4] for row in aside] == [("bad", 0, 3 + i, payload) for i, payload in enumerate(hostile[:5])]
    assert "undecodable" in aside[0][4] and "not [kind, {data}]" in aside[2][4] and "Unicode" in aside[4][4]
    assert _rows(db_path, "SELECT status FROM runs ORDER BY run_id") == [("ok",), ("ok",)]


def test_a_ring_truncated_while_draining_ends_its_rank_and_the_others_flow(runtime_dir: Path,
                                                                            db_path: Path) -> None:
    cut = RingWriter(runtime_dir / "cut-r0.ring", run_id="cut", meta={}, capacity=1024)
    other = RingWriter(runtime_dir / "other-r0.ring", run_id="other", meta={}, capacity=1024)
    for step in range(10):
        cut.write_sample(step, step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    collector.scan()
    collector.poll()
    os.truncate(runtime_dir / "cut-r0.ring", 4096)
    for step in range(10):
        other.write_sample(step, step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    collector.poll()
    collector.poll()
    assert writer.flush(timeout=30)
    assert _rows(db_path, "SELECT run_id, status, records FROM ranks ORDER BY run_id") == [
        ("cut", "error", 10), ("other", "running", 10)]
    assert _rows(db_path, "SELECT status FROM runs WHERE run_id = 'cut'") == [("error",)]
