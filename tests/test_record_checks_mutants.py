"""The record checks at the exact edge of each bound, and the screen of a drain read at C speed.

Every number is worked out by hand from the documented bounds: an 8-byte reading is 0..2**56 - 1 (top byte
zero), a 4-byte one 0..2**31 - 1 (top byte under 0x80), either may be -1 (not measured); a step is
0..2**63 - 1, a time 0..2**62; an integer anywhere in JSON fits 64 signed bits; text is at most 4,096
characters. A reading just past its bound must be set aside whichever byte gives it away, wherever its slot
sits among event chunks, and the record set aside keeps its time when that time is itself in range.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memwatch.sidecar.record_checks import check_event, check_meta, check_sample, check_value, screen
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_format import event_slots, sample_slot
from memwatch_engine.ring_reader import RingReader

MAX_INT = 2**63 - 1
MIN_INT = -(2**63)
MAX_TS = 2**62
MAX_BYTES = 2**56 - 1
MAX_INT32 = 2**31 - 1
READINGS = ("allocated", "peak", "reserved", "driver_used", "driver_free", "num_tokens", "kv_used", "kv_total",
            "num_seqs", "segments", "active", "inactive_split", "alloc_retries", "num_ooms")
BYTES_REASON = "outside 0..72057594037927935 (or -1: not measured)"
INT32_REASON = "outside 0..2147483647 (or -1: not measured)"


def _record(step: int = 1, ts_ns: int = 10, width: int = 21, **readings: int) -> tuple[int, ...]:
    """A drained sample tuple: seq 0, type 1, flags/phase/step kind 0, every reading 0 unless given."""
    values = [readings.get(name, 0) for name in READINGS]
    return (0, 1, 0, 0, 0, step, ts_ns, *values)[:width]


# --- check_field, through metadata and events ------------------------------------------------------------------

def test_a_field_that_may_not_be_null_is_missing_when_absent() -> None:
    assert check_event(1, 5, "phase_end", {}) == "phase_end event: phase is missing"
    assert check_event(1, 5, "request_finished", {"output_tokens": 3}) == (
        "request_finished event: request_id is missing")
    assert check_event(None, 5, "custom", {}) == "event step is missing"
    assert check_event(1, None, "custom", {}) == "event ts_ns is missing"


def test_an_event_step_or_time_must_be_an_integer() -> None:
    assert check_event(1.5, 5, "custom", {}) == "event step is float, not an integer"
    assert check_event(1, 5.5, "custom", {}) == "event ts_ns is float, not an integer"
    assert check_event(MAX_INT, MAX_TS, "custom", {}) is None
    assert check_event(1, MAX_TS + 1, "custom", {}) == f"event ts_ns is {MAX_TS + 1}, outside 0..{MAX_TS}"


def test_metadata_config_must_be_an_object() -> None:
    assert check_meta({"config": {"a": 1}}) is None
    assert check_meta({"config": [1]}) == "metadata config is list, not an object"
    assert check_meta({"config": "x"}) == "metadata config is str, not an object"


def test_a_metadata_text_of_4096_characters_is_taken_and_4097_is_refused() -> None:
    assert check_meta({"model": "m" * 4096}) is None
    assert check_meta({"model": "m" * 4097}) == "metadata model is 4,097 characters (at most 4,096)"


def test_a_request_id_is_any_64_bit_integer_or_text() -> None:
    def arrived(request_id: Any) -> str | None:
        return check_event(1, 5, "request_arrived", {"request_id": request_id, "prompt_tokens": 3})

    assert arrived(MIN_INT) is None
    assert arrived(-1) is None
    assert arrived(MAX_INT) is None
    assert arrived("r-1") is None
    assert arrived(MIN_INT - 1) == (
        f"request_arrived event: request_id is {MIN_INT - 1}, outside {MIN_INT}..{MAX_INT}")
    assert arrived(MAX_INT + 1) == (
        f"request_arrived event: request_id is {MAX_INT + 1}, outside {MIN_INT}..{MAX_INT}")


def test_metadata_that_is_not_an_object_or_holds_a_bad_extra_is_refused() -> None:
    assert check_meta([1]) == "metadata is not a JSON object"
    assert check_meta({"extra": MAX_INT}) is None
    assert check_meta({"extra": MAX_INT + 1}) == f"metadata.extra is {MAX_INT + 1}, beyond a 64-bit integer"
    assert check_meta({"extra": {"deep": "x" * 4097}}) == (
        "metadata.extra.deep is 4,097 characters (at most 4,096)")


# --- check_value ---------------------------------------------------------------------------------------------

def test_json_integers_from_minus_2_to_the_63_up_to_2_to_the_63_minus_1_are_taken() -> None:
    assert check_value("data", MIN_INT) is None
    assert check_value("data", MAX_INT) is None
    assert check_value("data", MIN_INT - 1) == f"data is {MIN_INT - 1}, beyond a 64-bit integer"
    assert check_value("data", MAX_INT + 1) == f"data is {MAX_INT + 1}, beyond a 64-bit integer"


def test_null_true_and_finite_floats_are_taken_and_non_finite_ones_refused() -> None:
    assert check_value("data", None) is None
    assert check_event(1, 5, "custom", {"a": None, "b": True, "c": 0.5}) is None
    assert check_value("data", 1.5) is None
    assert check_value("data", float("inf")) == "data is inf, not a finite number"
    assert check_value("data", float("-inf")) == "data is -inf, not a finite number"
    assert check_value("data", float("nan")) == "data is nan, not a finite number"


def test_a_json_text_of_4096_characters_is_taken_and_4097_is_refused() -> None:
    assert check_value("data", "t" * 4096) is None
    assert check_value("data", "t" * 4097) == "data is 4,097 characters (at most 4,096)"
    assert check_event(1, 5, "custom", {"note": "t" * 4097}) == (
        "custom event: data.note is 4,097 characters (at most 4,096)")


def test_a_value_json_cannot_hold_is_refused_by_its_type() -> None:
    assert check_value("data", b"ab") == "data is bytes"
    assert check_value("data", {"a": [1, {1, 2}]}) == "data.a.1 is set"


def test_a_huge_integer_is_named_by_its_size_from_10_to_the_30() -> None:
    """10**30 needs 100 bits (2**99 < 10**30 < 2**100); 10**30 - 1 is written out, 30 nines."""
    assert check_value("data", 10**30 - 1) == f"data is {'9' * 30}, beyond a 64-bit integer"
    assert check_value("data", -(10**30) + 1) == f"data is -{'9' * 30}, beyond a 64-bit integer"
    assert check_value("data", 10**30) == "data is a number of 100 bits, beyond a 64-bit integer"
    assert check_value("data", -(10**30)) == "data is -a number of 100 bits, beyond a 64-bit integer"
    assert check_value("data", 2**5000) == "data is a number of 5001 bits, beyond a 64-bit integer"


# --- check_sample --------------------------------------------------------------------------------------------

def test_a_sample_at_every_upper_bound_or_not_measured_is_taken() -> None:
    assert check_sample(_record(step=MAX_INT, ts_ns=MAX_TS)) is None
    top = {name: MAX_BYTES for name in READINGS} | {
        name: MAX_INT32 for name in ("kv_used", "kv_total", "num_seqs", "segments", "alloc_retries", "num_ooms")}
    assert check_sample(_record(**top)) is None
    assert check_sample(_record(**{name: -1 for name in READINGS})) is None


def test_a_sample_one_past_a_bound_is_refused() -> None:
    assert check_sample(_record(step=MAX_INT + 1)) == f"sample step is {MAX_INT + 1}, outside 0..{MAX_INT}"
    assert check_sample(_record(ts_ns=-1)) == f"sample ts_ns is -1, outside 0..{MAX_TS}"
    assert check_sample(_record(allocated=-2)) == f"sample allocated is -2, {BYTES_REASON}"
    assert check_sample(_record(num_ooms=MAX_INT32 + 1)) == f"sample num_ooms is {MAX_INT32 + 1}, {INT32_REASON}"


def test_a_version_1_sample_of_16_fields_is_checked_up_to_num_seqs() -> None:
    assert check_sample(_record(width=16)) is None
    assert check_sample(_record(width=16, num_seqs=-2)) == f"sample num_seqs is -2, {INT32_REASON}"


# --- screen: a drain read from a ring ------------------------------------------------------------------------

def _drain(tmp_path: Path, slots: list[bytes]) -> SimpleNamespace:
    """``slots`` written to a fresh ring, drained, and screened."""
    ring = RingWriter(tmp_path / "s-r0.ring", run_id="s", meta={}, capacity=64)
    ring.write_slots(slots)
    reader = RingReader(ring.path)
    drained = reader.drain(0)
    reader.close()
    ring.close()
    assert drained.bad == []
    return screen(SimpleNamespace(samples=list(drained.samples), events=list(drained.events), bad=[],
                                  slots=drained.slots))


def _sample(ts_ns: int = 11, **readings: int) -> bytes:
    return sample_slot(1, ts_ns, 0, 0, 0, **{name: readings.get(name, 0) for name in READINGS})


def _event() -> bytes:
    [slot] = event_slots(1, 12, "x", {})  # 8 bytes of JSON: the rest of the chunk is zero
    return slot


BAD_READINGS = [
    ("allocated", 2**56, BYTES_REASON),  # top byte 0x01
    ("allocated", 2**57, BYTES_REASON),  # top byte 0x02
    ("num_tokens", 2**63 - 1, BYTES_REASON),  # top byte 0x7f
    ("inactive_split", 2**56, BYTES_REASON),
    ("allocated", -2, BYTES_REASON),
    ("kv_used", -(2**31), INT32_REASON),  # top byte 0x80
    ("kv_used", -2, INT32_REASON),
    ("num_ooms", -(2**31), INT32_REASON),
]


@pytest.mark.parametrize(("name", "value", "bound"), BAD_READINGS)
def test_a_drain_whose_only_bad_value_is_one_reading_sets_that_sample_aside(
        tmp_path: Path, name: str, value: int, bound: str) -> None:
    screened = _drain(tmp_path, [_sample(ts_ns=10), _sample(ts_ns=11, **{name: value}), _sample(ts_ns=12)])
    [(seq, ts, why, raw)] = screened.bad
    assert (seq, ts, why) == (1, 11, f"sample {name} is {value}, {bound}")
    assert json.loads(raw) == [1, 1, 0, 0, 0, 1, 11, *(value if n == name else 0 for n in READINGS)]
    assert [record[6] for record in screened.samples] == [10, 12]


@pytest.mark.parametrize(("name", "value", "bound"), BAD_READINGS)
@pytest.mark.parametrize("event_first", [True, False])
def test_a_bad_reading_is_seen_next_to_an_event_chunk(
        tmp_path: Path, name: str, value: int, bound: str, event_first: bool) -> None:
    slots = [_event(), _sample(**{name: value})] if event_first else [_sample(**{name: value}), _event()]
    screened = _drain(tmp_path, slots)
    assert [(ts, why) for _, ts, why, _ in screened.bad] == [(11, f"sample {name} is {value}, {bound}")]
    assert screened.samples == []
    assert [event[3] for event in screened.events] == ["x"]


def test_readings_at_their_bounds_or_not_measured_pass_the_screen(tmp_path: Path) -> None:
    top = {name: MAX_BYTES for name in READINGS} | {
        name: MAX_INT32 for name in ("kv_used", "kv_total", "num_seqs", "segments", "alloc_retries", "num_ooms")}
    screened = _drain(tmp_path, [_event(), _sample(**top), _sample(**{name: -1 for name in READINGS}), _event()])
    assert screened.bad == []
    assert len(screened.samples) == 2


def test_a_sample_set_aside_at_the_last_time_keeps_that_time(tmp_path: Path) -> None:
    screened = _drain(tmp_path, [_sample(ts_ns=MAX_TS, allocated=-2)])
    assert [(ts, why) for _, ts, why, _ in screened.bad] == [(MAX_TS, f"sample allocated is -2, {BYTES_REASON}")]


def test_samples_without_copied_slots_are_each_checked() -> None:
    """A drain that hands no slots (nothing to read at C speed) still has every reading checked."""
    bad = _record(ts_ns=11, allocated=2**56)
    screened = screen(SimpleNamespace(samples=[_record(), bad], events=[], bad=[], slots=b""))
    assert [(ts, why) for _, ts, why, _ in screened.bad] == [(11, f"sample allocated is {2**56}, {BYTES_REASON}")]
    assert screened.samples == [_record()]


def test_a_version_1_slot_with_garbage_in_its_padding_is_taken() -> None:
    """Bytes 92..127 of a version 1 sample are padding: what a foreign writer leaves there is no reading."""
    slot = bytearray(128)
    slot[8] = 1  # a sample
    slot[16] = 1  # step 1
    slot[24] = 10  # time 10
    slot[92:128] = b"\xff" * 36
    record = _record(width=16)
    screened = screen(SimpleNamespace(samples=[record], events=[], bad=[], slots=bytes(slot)))
    assert screened.bad == []
    assert screened.samples == [record]


# --- screen: events ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("ts_ns", "kept_ts"), [(11, 11), (0, 0), (MAX_TS, MAX_TS), (-1, 0), (MAX_TS + 1, 0)])
def test_an_event_set_aside_keeps_its_time_only_when_in_range(ts_ns: int, kept_ts: int) -> None:
    events = [(7, 1, ts_ns, "", {"a": 1}), (8, 1, 5, "ok", {})]
    screened = screen(SimpleNamespace(samples=[], events=events, bad=[], slots=b""))
    [(seq, ts, why, raw)] = screened.bad
    assert (seq, ts) == (7, kept_ts)
    in_range = 0 <= ts_ns <= MAX_TS
    assert why == ("event kind is not 1 to 64 characters of text" if in_range else
                   f"event ts_ns is {ts_ns}, outside 0..{MAX_TS}")
    assert json.loads(raw) == ["", {"a": 1}]
    assert screened.events == [(8, 1, 5, "ok", {})]
