"""Every decoded field of every event kind, and every sample, is checked before a detector sees it: a
non-finite number, a value of the wrong type or out of range sets its record aside with the reason;
the sidecar (live detectors included) keeps draining, and the cursor moves past it."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from memwatch.sidecar.collector import Collector
from memwatch.sidecar.live import LiveDetectors
from memwatch.sidecar.record_checks import EVENT_FIELDS, MAX_TS_NS
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_format import _CHUNK, CHUNK_PAYLOAD, HEADER_SIZE, RECORD_SIZE

from stored_runs import drain

# Hand-chosen bad values (raw JSON text) per field type, each with the words its refusal must hold.
NON_FINITE = [("1e999", "not a finite number"), ("-1e999", "not a finite number"), ("NaN", "not a JSON number")]
BAD = {
    "int": [('"7"', "is str, not an integer"), ("7.5", "is float, not an integer"), ("-1", "outside 0.."),
            ("9223372036854775808", "outside 0.."), ("true", "is bool, not an integer"),
            ("[1]", "is list, not an integer")],
    "number": [('"0.5"', "is str, not a number"), ("1.5", "outside 0..1"), ("-0.25", "outside 0..1"),
               ("{}", "is dict, not a number")],
    "text": [("42", "is int, not text"), ('["a"]', "is list, not text"), ('{"a": 1}', "is dict, not text"),
             ('"' + "x" * 5000 + '"', "5,000 characters")],
    "id": [("[1, 2]", "is list, not an integer"), ('{"a": 1}', "is dict, not an integer"),
           ("1.5", "is float, not an integer"), ('"' + "x" * 5000 + '"', "5,000 characters")],
}
GOOD = {"int": "3", "number": "0.5", "text": '"serve"', "id": "17"}


def _raw_event(writer: RingWriter, payload: bytes, step: int = 1, ts_ns: int = 5) -> None:
    """An event written byte for byte, as a foreign or hostile writer would (no cleaning)."""
    seq = writer.written
    chunks = [payload[i : i + CHUNK_PAYLOAD] for i in range(0, len(payload), CHUNK_PAYLOAD)]
    for i, chunk in enumerate(chunks):
        _CHUNK.pack_into(writer._map, HEADER_SIZE + ((seq + i) & writer._mask) * RECORD_SIZE, seq + i, 2,
                         int(i + 1 < len(chunks)), len(chunk), step, ts_ns, chunk)
    writer._cursor[0] = end = seq + len(chunks)
    writer._map[56:64] = end.to_bytes(8, "little")


def _payload(kind: str, fields: dict[str, str]) -> bytes:
    return f'["{kind}", {{{", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items())}}}]'.encode()


def _store_live(runtime_dir: Path, db_path: Path) -> Collector:
    """The sidecar's path: the collector with the live detectors, every ring drained and committed."""
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: False,
                          observers=[LiveDetectors()])
    collector.scan()
    drain(collector)
    assert writer.flush(timeout=30) and writer.error is None, writer.error
    collector.close()
    writer.close()
    return collector


def _rows(db_path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(db_path) as conn:
        return conn.execute(sql).fetchall()


def _sample(ring: RingWriter, step: int, ts_ns: int) -> None:
    ring.write_sample(step, ts_ns, 5, 2, 0, 100, 200, 300, 400, 500, 6, 7, 8, 9, 1, 100, 0, 0, 0)


def test_an_infinite_number_is_set_aside_and_the_sidecar_with_its_detectors_keeps_draining(
        runtime_dir: Path, db_path: Path) -> None:
    ring = RingWriter(runtime_dir / "inf-r0.ring", run_id="inf", meta={"engine": "raw"}, capacity=256)
    _sample(ring, 0, 10)
    ring.write_event(0, 11, "phase_start", {"phase": "serve", "code": 5})
    _raw_event(ring, b'["kv_allocated", {"total_bytes": 1e999, "num_blocks": 10, "block_bytes": 100}]')
    _raw_event(ring, b'["preemption", {"count": 1e999}]')
    _sample(ring, 1, 20)
    ring.close()
    collector = _store_live(runtime_dir, db_path)  # before the fix: OverflowError out of the detectors
    assert collector.set_aside_total == 2
    reasons = [row[0] for row in _rows(db_path, "SELECT reason FROM set_aside ORDER BY seq")]
    assert all("1e999 is not a finite number" in reason for reason in reasons), reasons
    assert _rows(db_path, "SELECT count(*) FROM samples") == [(2,)]
    assert _rows(db_path, "SELECT status, lost_records FROM ranks") == [("ok", 0)]
    assert _rows(db_path, "SELECT next_seq, finished FROM ring_cursors") == [(ring.written, 1)]


@pytest.mark.parametrize("kind", sorted(EVENT_FIELDS))
def test_every_field_of_every_event_kind_refuses_non_finite_and_wrongly_typed_values(
        kind: str, runtime_dir: Path, db_path: Path) -> None:
    fields = EVENT_FIELDS[kind]
    baseline = {name: GOOD[field.type] for name, field in fields.items()}
    ring = RingWriter(runtime_dir / "bad-r0.ring", run_id="bad", meta={"engine": "raw"}, capacity=8192)
    _sample(ring, 0, 10)
    expected = []
    for name, field in fields.items():
        for value, words in [*NON_FINITE, *BAD[field.type]]:
            _raw_event(ring, _payload(kind, {**baseline, name: value}))
            expected.append((name, value, words))
    _raw_event(ring, _payload(kind, baseline))  # the same kind with good values flows
    _sample(ring, 1, 20)
    ring.close()
    collector = _store_live(runtime_dir, db_path)
    aside = _rows(db_path, "SELECT reason FROM set_aside ORDER BY seq")
    assert collector.set_aside_total == len(expected) == len(aside)
    for (name, value, words), (reason,) in zip(expected, aside, strict=True):
        assert words in reason, (name, value[:20], reason)
        if words not in ("not a finite number", "not a JSON number"):  # refused by the parser, before fields
            assert f"{kind} event: {name} " in reason, (name, value[:20], reason)
    stored = _rows(db_path, f"SELECT data FROM events WHERE kind = '{kind}'")
    assert [json.loads(data) for (data,) in stored] == [{k: json.loads(v) for k, v in baseline.items()}]
    assert _rows(db_path, "SELECT count(*) FROM samples") == [(2,)]


def test_an_event_or_sample_with_a_negative_or_far_future_step_or_time_is_set_aside(
        runtime_dir: Path, db_path: Path) -> None:
    ring = RingWriter(runtime_dir / "far-r0.ring", run_id="far", meta={"engine": "raw"}, capacity=256)
    _sample(ring, 0, 10)
    _sample(ring, -3, 11)
    _sample(ring, 1, MAX_TS_NS + 1)
    _sample(ring, 2, (1 << 63) - 1)
    ring.write_event(-1, 12, "custom", {"a": 1})
    ring.write_event(1, (1 << 63) - 1, "custom", {"a": 2})
    ring.write_event(1, 13, "custom", {"deep": {"n": 1 << 70}})
    ring.write_event(1, 14, "k" * 65, {})
    _sample(ring, 3, 15)
    ring.close()
    collector = _store_live(runtime_dir, db_path)
    reasons = [row[0] for row in _rows(db_path, "SELECT reason FROM set_aside ORDER BY seq")]
    assert collector.set_aside_total == 7
    assert reasons == [
        "sample step is -3, outside 0..9223372036854775807",
        f"sample ts_ns is {MAX_TS_NS + 1}, outside 0..{MAX_TS_NS}",
        f"sample ts_ns is {(1 << 63) - 1}, outside 0..{MAX_TS_NS}",
        "event step is -1, outside 0..9223372036854775807",
        f"event ts_ns is {(1 << 63) - 1}, outside 0..{MAX_TS_NS}",
        f"custom event: data.deep.n is {1 << 70}, beyond a 64-bit integer",
        "event kind is not 1 to 64 characters of text",
    ]
    assert _rows(db_path, "SELECT step, ts_ns FROM samples ORDER BY step") == [(0, 10), (3, 15)]
    assert _rows(db_path, "SELECT status FROM runs") == [("ok",)]
