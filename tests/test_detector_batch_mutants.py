"""The batch path's columns and gates at their edges, with every expected number worked out by hand.

One rank is sized with small round numbers so each ledger term of a sample can be derived on paper:

* weights 1,000; sizing ``current`` 1,200, so other long-lived PyTorch memory is 200 (not 0);
* KV 10 blocks of 100 = 1,000; long-lived = 1,000 + 200 + 1,000 = 2,200;
* activation reserve ``peak - current`` = 1,500 - 1,200 = 300, the forward need before any step rise;
* budget 10,000 x 0.5 = 5,000.

The default sample: allocated 2,500, peak 2,600 (the step's own), reserved 2,700, driver used 3,500 and
free 1,000, active 2,500, pinned 100. So non-PyTorch 800, slack 200, reclaimable 2,700 - 2,500 - 100 = 100,
rise 100 (under the need of 300), margin 1,000 + 100 - 300 = 800, activation now 2,500 - 2,200 = 300,
kept 300 + 200 = 500, step activation 2,600 - 2,200 = 400, headroom 5,000 - 800 - 2,200 - 300 = 1,700.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from memwatch.detectors import DetectorSet, RankSummary
from memwatch.detectors.base import Episode
from memwatch.detectors.batch import (
    MIN_BATCH,
    Columns,
    DrainColumns,
    active_after,
    batchable,
    numpy_or_none,
    ring_columns,
    terms_at,
)
from memwatch.errors import UsageError
from memwatch.ledger import Ledger
from memwatch.records import Event
from memwatch.ring_records import typed_records, typed_sample
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_reader import RingReader

RUN, RANK, SERVE, WARMUP = "edge", 0, 5, 2
NAMES: dict[int, str | None] = {SERVE: "serve", WARMUP: "warmup"}
SIZING_EVENTS = (
    Event(RUN, RANK, 0, 1, "weights_loaded", {"weights_bytes": 1000}),
    Event(RUN, RANK, 0, 2, "kv_allocated", {
        "total_bytes": 10_000, "gpu_memory_utilization": 0.5, "used_bytes": 1800, "peak_bytes": 1500,
        "current_bytes": 1200, "reserved_bytes": 1300, "block_bytes": 100, "num_blocks": 10}),
)
PRESENT = {"allocated": 7, "peak": 8, "reserved": 9, "used": 10, "free": 11, "active": 17, "pinned": 18,
           "retries": 19, "ooms": 20}
"""Ring tuple positions of the readings the fast path needs measured."""


def _row(step: int, *, allocated: int = 2500, peak: int = 2600, flags: int = 1, reserved: int = 2700,
         used: int = 3500, free: int = 1000, active: int = 2500, pinned: int = 100, phase: int = SERVE,
         kv_used: int = 3, kv_total: int = 10, retries: int = 0, ooms: int = 0) -> tuple[int, ...]:
    """A version 2 ring sample tuple: seq, type, flags, phase, kind, step, ts, allocated, peak, reserved, used,
    free, tokens, kv_used, kv_total, seqs, segments, active, pinned, retries, ooms."""
    return (step, 1, flags, phase, 2, step, 1000 + step, allocated, peak, reserved, used, free, 16, kv_used,
            kv_total, 4, 8, active, pinned, retries, ooms)


def _rows(n: int, **changes: dict[int, dict[str, int]]) -> list[tuple[int, ...]]:
    at = changes.get("at", {})
    return [_row(step, **at.get(step, {})) for step in range(n)]


def _ledger() -> Ledger:
    ledger = Ledger()
    for event in SIZING_EVENTS:
        ledger.on_event(event)
    return ledger


def _columns(rows: list[tuple[int, ...]], ledger: Ledger | None = None) -> Columns:
    fields = ring_columns(np, rows)
    assert fields is not None
    return Columns(np, fields, ledger or _ledger())


def test_the_sizing_terms_are_the_hand_derived_ones() -> None:
    ledger = _ledger()
    assert (ledger._long_lived, ledger._torch_other, ledger._activation_reserve, ledger._budget,
            ledger._forward_need) == (2200, 200, 300, 5000, 300)


def test_every_column_of_a_plain_sample_has_its_hand_derived_value() -> None:
    batch = _columns(_rows(MIN_BATCH))
    assert batch.n == 64
    one = {name: int(getattr(batch, name)[0]) for name in (
        "non_torch", "slack", "reclaimable", "need", "need_before", "margin", "step_activation", "activation_now",
        "kept", "headroom", "allocated", "peak", "reserved", "used", "driver_free", "active", "pinned", "kv_used",
        "kv_total", "retries", "num_ooms", "step", "ts")}
    assert one == {"non_torch": 800, "slack": 200, "reclaimable": 100, "need": 300, "need_before": 300,
                   "margin": 800, "step_activation": 400, "activation_now": 300, "kept": 500, "headroom": 1700,
                   "allocated": 2500, "peak": 2600, "reserved": 2700, "used": 3500, "driver_free": 1000,
                   "active": 2500, "pinned": 100, "kv_used": 3, "kv_total": 10, "retries": 0, "num_ooms": 0,
                   "step": 0, "ts": 1000}
    assert (batch.long_lived, batch.reserve, batch.budget) == (2200, 300, 5000)
    assert batch.peak_is_step.dtype == bool and bool(batch.peak_is_step[0])


def test_activation_now_and_kept_follow_allocated_byte_for_byte() -> None:
    """One byte more allocated is one byte more activation and kept memory; at long-lived exactly, 0."""
    batch = _columns(_rows(MIN_BATCH, at={1: {"allocated": 2501, "active": 2501}, 2: {"allocated": 2200,
                                                                                        "active": 2200}}))
    assert batch.activation_now[:3].tolist() == [300, 301, 0]
    assert batch.kept[:3].tolist() == [500, 501, 200]  # other long-lived PyTorch memory (200) counted once


def test_a_new_record_rise_mid_batch_raises_the_need_from_that_sample_on() -> None:
    """Need 300 until sample 10 rises 450 over allocated; a smaller rise (350) keeps 450; a larger rise on a
    sample whose peak is not the step's own (flags 0 or 2) counts for nothing; flags 3 is a step peak (500)."""
    at = {10: {"peak": 2950}, 20: {"peak": 2850}, 30: {"peak": 3400, "flags": 0}, 40: {"peak": 3400, "flags": 2},
          50: {"peak": 3000, "flags": 3}}
    batch = _columns(_rows(MIN_BATCH, at=at))
    assert batch.need.tolist() == [300] * 10 + [450] * 40 + [500] * 14
    assert batch.need_before.tolist() == [300] * 11 + [450] * 40 + [500] * 13
    assert batch.peak_is_step[[10, 30, 40, 50]].tolist() == [True, False, False, True]
    assert batch.margin[[9, 10, 50]].tolist() == [800, 1000 + 100 - 450, 1000 + 100 - 500]


def test_a_rise_exactly_at_the_need_leaves_it_and_one_byte_more_raises_it() -> None:
    batch = _columns(_rows(MIN_BATCH, at={3: {"peak": 2800}, 5: {"peak": 2801}}))
    assert batch.need[[2, 3, 4, 5, 6]].tolist() == [300, 300, 300, 301, 301]


def test_reclaimable_cache_is_clamped_at_zero_when_reserved_is_below_active_plus_pinned() -> None:
    """Reserved 2,700: active + pinned 2,750 and 2,700 leave nothing reclaimable, 2,699 leaves 1 byte."""
    at = {0: {"active": 2650}, 1: {"active": 2600}, 2: {"active": 2599}}
    batch = _columns(_rows(MIN_BATCH, at=at))
    assert batch.reclaimable[:4].tolist() == [0, 0, 1, 100]
    assert batch.margin[:4].tolist() == [700, 700, 701, 800]


def test_columns_match_the_ledger_fed_sample_by_sample_and_terms_at_leaves_the_ledger_alone() -> None:
    at = {4: {"active": 2690, "pinned": 50}, 7: {"peak": 2990}, 9: {"free": 0, "used": 9000},
          12: {"peak": 3100, "flags": 0}, 15: {"allocated": 2300, "peak": 2800, "active": 2300}}
    rows = _rows(MIN_BATCH, at=at)
    ledger = _ledger()
    batch = _columns(rows, ledger)
    sequential = _ledger()
    for index, sample in enumerate(typed_records(RUN, RANK, SimpleNamespace(samples=rows, events=()), NAMES)):
        terms = sequential.on_sample(sample)  # type: ignore[arg-type]
        assert terms_at(ledger, sample, int(batch.need_before[index])) == terms, index  # type: ignore[arg-type]
        assert ledger._forward_need == 300  # the batch's own ledger is not moved by a probe
        assert (terms.non_torch_bytes, terms.cache_slack_bytes, terms.reclaimable_cache_bytes,
                terms.oom_margin_bytes, terms.activation_now_bytes, terms.torch_kept_bytes,
                terms.step_activation_peak_bytes, terms.headroom_bytes) == (
            batch.non_torch[index], batch.slack[index], batch.reclaimable[index], batch.margin[index],
            batch.activation_now[index], batch.kept[index],
            batch.step_activation[index] if batch.peak_is_step[index] else None,  # a step's own peak only
            batch.headroom[index]), index
    assert sequential._forward_need == int(batch.need[-1]) == 2800 - 2300  # sample 15's rise


def test_batchable_needs_sixty_four_samples() -> None:
    assert batchable(np, ring_columns(np, _rows(64)), _ledger(), frozenset())
    assert not batchable(np, ring_columns(np, _rows(63)), _ledger(), frozenset())


@pytest.mark.parametrize("name", sorted(PRESENT))
def test_batchable_refuses_a_missing_reading_and_takes_a_zero_one(name: str) -> None:
    """-1 in the ring is "not measured" (one such sample sends the drain per-sample); 0 is a measurement."""
    missing = ring_columns(np, _rows(64, at={40: {name: -1}}))
    zero = ring_columns(np, _rows(64, at={40: {name: 0}}))
    assert not batchable(np, missing, _ledger(), frozenset())
    assert batchable(np, zero, _ledger(), frozenset())


def test_batchable_ignores_readings_it_does_not_need() -> None:
    fields = ring_columns(np, _rows(64, at={5: {"kv_used": -1, "kv_total": -1}}))
    assert batchable(np, fields, _ledger(), frozenset())


def test_batchable_refuses_startup_phases_anywhere_in_the_batch() -> None:
    startup = frozenset({WARMUP, 7})
    assert batchable(np, ring_columns(np, _rows(64)), _ledger(), startup)
    assert not batchable(np, ring_columns(np, _rows(64, at={63: {"phase": WARMUP}})), _ledger(), startup)
    assert not batchable(np, ring_columns(np, _rows(64, at={0: {"phase": 7}})), _ledger(), startup)


@pytest.mark.parametrize("term", ["_forward_need", "_long_lived", "_activation_reserve", "_budget"])
def test_batchable_refuses_a_ledger_without_a_sizing_term(term: str) -> None:
    ledger = _ledger()
    setattr(ledger, term, None)
    assert not batchable(np, ring_columns(np, _rows(64)), ledger, frozenset())


def test_ring_columns_reads_only_the_fields_the_detectors_use_and_refuses_a_version_1_ring() -> None:
    fields = ring_columns(np, _rows(3))
    assert fields is not None and len(fields) == 21
    read = {2, 3, 5, 6, 7, 8, 9, 10, 11, 13, 14, 17, 18, 19, 20}
    assert [at for at, field in enumerate(fields) if field is not None] == sorted(read)
    assert all(fields[at].dtype == np.int64 for at in read)
    assert fields[7].tolist() == [2500, 2500, 2500] and fields[5].tolist() == [0, 1, 2]
    assert ring_columns(np, [row[:16] for row in _rows(3)]) is None  # no allocator signals


def _ring_drain(tmp_path: Path) -> Any:
    """Three samples with events before, between and after them, values past 32 bits and a missing free."""
    big = 5 << 32
    path = tmp_path / "edge-r0.ring"
    writer = RingWriter(path, run_id=RUN, rank=RANK, capacity=64)
    writer.write_event(0, 1, "phase_start", {"phase": "serve", "code": SERVE})
    writer.write_sample(1, 11, SERVE, 2, 1, big + 1, big + 2, big + 3, big + 4, big + 5, 6, 70_000, 80_000, 9, 10,
                        big + 11, big + 12, 13, 14)
    writer.write_event(1, 12, "request_arrived", {"request_id": 1, "prompt_tokens": 9})
    writer.write_sample(2, 21, SERVE, 1, 0, 2500, 2600, 2700, 3500, -1, 16, 3, 10, 4, 8, 2500, 100, 0, 0)
    writer.write_sample(3, 31, 3, 1, 3, 2400, 2650, 2700, 3400, 1100, 16, 0, 10, 4, 8, 2400, 0, 2, 1)
    writer.write_event(3, 32, "request_arrived", {"request_id": 2, "prompt_tokens": 9})
    writer.close()
    reader = RingReader(path)
    try:
        return reader.drain(0)
    finally:
        reader.close()


def test_ring_columns_from_the_slot_bytes_equal_those_from_the_tuples(tmp_path: Path) -> None:
    drained = _ring_drain(tmp_path)
    assert drained.slots and len(drained.samples) == 3 and drained.events
    from_tuples = ring_columns(np, drained.samples)
    from_slots = ring_columns(np, drained.samples, drained.slots)
    assert from_tuples is not None and from_slots is not None
    assert [field is None for field in from_slots] == [field is None for field in from_tuples]
    for at, (mine, theirs) in enumerate(zip(from_slots, from_tuples, strict=True)):
        if theirs is not None:
            assert mine.dtype == np.int64 and mine.tolist() == theirs.tolist(), at
    big = 5 << 32
    assert from_slots[7].tolist() == [big + 1, 2500, 2400]
    assert from_slots[11].tolist() == [big + 5, -1, 1100]
    assert from_slots[2].tolist() == [1, 0, 3] and from_slots[3].tolist() == [SERVE, SERVE, 3]
    assert from_slots[13].tolist() == [70_000, 3, 0] and from_slots[14].tolist() == [80_000, 10, 10]
    assert from_slots[17].tolist() == [big + 11, 2500, 2400] and from_slots[18].tolist() == [big + 12, 100, 0]
    assert from_slots[19].tolist() == [13, 0, 2] and from_slots[20].tolist() == [14, 0, 1]
    assert from_slots[5].tolist() == [1, 2, 3] and from_slots[6].tolist() == [11, 21, 31]


def test_ring_columns_falls_back_to_the_tuples_when_the_slots_hold_other_samples(tmp_path: Path) -> None:
    drained = _ring_drain(tmp_path)
    fields = ring_columns(np, drained.samples[1:], drained.slots)
    assert fields is not None and fields[7].tolist() == [2500, 2400]


def test_drain_columns_hands_out_each_run_of_the_drain(tmp_path: Path) -> None:
    drained = _ring_drain(tmp_path)
    drain = DrainColumns(drained)
    first, rest = drain.part(range(0, 1))(np), drain.part(range(1, 3))(np)
    assert first is not None and rest is not None
    assert first[7].tolist() == [(5 << 32) + 1] and rest[7].tolist() == [2500, 2400]
    assert first[0] is None and rest[12] is None
    assert drain.part(range(0, 3))(np)[11].tolist() == [(5 << 32) + 5, -1, 1100]  # type: ignore[index]
    version_1 = DrainColumns(SimpleNamespace(samples=[row[:16] for row in _rows(3)], slots=b""))
    assert version_1.part(range(0, 3))(np) is None


def test_active_after_follows_the_plan() -> None:
    idle, active = Episode(3), Episode(3)
    active.active = True
    assert active_after(np, idle, (2, 3), 4).tolist() == [False] * 4
    assert active_after(np, active, (-1, 1), 4).tolist() == [True] * 4
    assert active_after(np, active, (2, 3), 4).tolist() == [True, True, False, False]
    assert active_after(np, active, (0, 3), 3).tolist() == [False] * 3


def test_numpy_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert numpy_or_none() is np
    monkeypatch.setitem(sys.modules, "numpy", None)
    assert numpy_or_none() is None


def _per_sample(rows: list[tuple[int, ...]]) -> tuple[list[Any], Any, Any]:
    detectors, summary, flags = DetectorSet(), RankSummary(RANK), []
    for event in SIZING_EVENTS:
        flags += detectors.on_event(event)
    for sample in typed_records(RUN, RANK, SimpleNamespace(samples=rows, events=()), NAMES):
        flags += detectors.on_sample(sample)  # type: ignore[arg-type]
        summary.observe(sample, detectors.last_terms(RANK))  # type: ignore[arg-type]
    return flags, summary.to_json(), detectors.last_terms(RANK)


def _batched(rows: list[tuple[int, ...]], drain: int) -> tuple[list[Any], Any, Any, int]:
    detectors, summary, flags = _Counting(), RankSummary(RANK), []
    for event in SIZING_EVENTS:
        flags += detectors.on_event(event)
    flags += detectors.on_ring_samples(RUN, RANK, rows[:1], NAMES, summary)  # serving starts per-sample
    for start in range(1, len(rows), drain):
        flags += detectors.on_ring_samples(RUN, RANK, rows[start:start + drain], NAMES, summary)
    return flags, summary.to_json(), detectors.last_terms(RANK), detectors.batched


class _Counting(DetectorSet):
    __slots__ = ("batched",)

    def __init__(self) -> None:
        super().__init__()
        self.batched = 0

    def _batches(self, *args: Any) -> int:
        covered = super()._batches(*args)
        self.batched += covered
        return covered


CASES = {
    "rise mid-batch": {100: {"peak": 2990}, 150: {"peak": 3100, "flags": 2}, 220: {"peak": 2950, "flags": 3}},
    "reserved under active + pinned": {step: {"active": 2650, "pinned": 120} for step in range(60, 200)},
    "driver free unknown": {step: {"free": -1} for step in range(70, 140)},
    "need rises on a drain's second last sample": {191: {"peak": 2990}},
    "kept memory rising": {step: {"allocated": 2500 + step, "active": 2500 + step, "peak": 2600 + step}
                           for step in range(1, 300)},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_flags_summary_and_terms_equal_the_per_sample_path(case: str) -> None:
    """Drains of 64 and of 257 samples; other long-lived PyTorch memory is 200, not 0."""
    rows = _rows(300, at=CASES[case])
    expected = _per_sample(rows)
    for drain in (64, 257):
        flags, summary, terms, batched = _batched(rows, drain)
        assert (flags, summary, terms) == expected, (case, drain)
        if drain == 64 or case != "driver free unknown":  # a missing reading in every 257-long try: per-sample
            assert batched >= 64, (case, drain)  # the batch path did take part
    if case == "driver free unknown":
        assert expected[2].oom_margin_bytes == 800
        assert typed_sample(RUN, RANK, rows[100], NAMES).driver_free_bytes is None


def test_with_the_drains_slots_the_columns_are_read_from_the_slot_bytes(tmp_path: Path) -> None:
    """As documented: given the slots, the bytes are the source (the tuples only count the samples)."""
    drained = _ring_drain(tmp_path)
    placeholders = [(0,) * 21] * 3
    fields = ring_columns(np, placeholders, drained.slots)
    assert fields is not None and fields[7].tolist() == [(5 << 32) + 1, 2500, 2400]
    drain = DrainColumns(SimpleNamespace(samples=placeholders, slots=drained.slots))
    assert drain.part(range(1, 3))(np)[9].tolist() == [2700, 2700]  # type: ignore[index]


def test_ring_columns_refuses_rows_of_unequal_length_instead_of_truncating() -> None:
    rows = _rows(2)
    with pytest.raises(ValueError):
        ring_columns(np, [rows[0], (*rows[1], 99)])


def _serving() -> tuple[_Counting, RankSummary]:
    """A rank 100 samples into serving (fed one by one), past every window that still fills."""
    detectors, summary = _Counting(), RankSummary(RANK)
    for event in SIZING_EVENTS:
        detectors.on_event(event)
    for row in _rows(100):
        detectors.on_ring_samples(RUN, RANK, [row], NAMES, summary)
    return detectors, summary


def test_ring_samples_of_another_run_are_refused_not_batched() -> None:
    detectors, summary = _serving()
    with pytest.raises(UsageError, match="records of run 'other' mixed into run 'edge'"):
        detectors.on_ring_samples("other", RANK, _rows(MIN_BATCH), NAMES, summary)
    assert detectors.batched == 0


def test_the_callers_columns_are_the_ones_batched() -> None:
    """A caller without columns (``None``) sends every sample one by one; with them, the drain is one batch."""
    rows = _rows(100 + MIN_BATCH)[100:]
    detectors, summary = _serving()
    detectors.on_ring_samples(RUN, RANK, rows, NAMES, summary, lambda np: None)
    assert detectors.batched == 0 and detectors.last_terms(RANK).headroom_bytes == 1700  # type: ignore[union-attr]
    detectors, summary = _serving()
    detectors.on_ring_samples(RUN, RANK, rows, NAMES, summary, lambda np: ring_columns(np, rows))
    assert detectors.batched == MIN_BATCH


def test_after_a_drain_the_fast_path_cannot_take_it_goes_16_samples_one_by_one_then_batches_the_rest() -> None:
    """Driver free unknown on the drain's first sample: no batch covers it, so the first stretch (8, doubled
    because nothing was batched) of 16 goes sample by sample and the other 284 of 300 as one batch."""
    rows = _rows(400, at={100: {"free": -1}})[100:]
    detectors, summary = _serving()
    detectors.on_ring_samples(RUN, RANK, rows, NAMES, summary)
    assert detectors.batched == 284
