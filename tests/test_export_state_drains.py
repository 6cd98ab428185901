"""The exported state fed as the sidecar feeds it: a real ring's own drains, with the detectors' ledger as the
terms source, and the ring's newest sample read between drains. Counts, KV view, headroom inputs, listeners and
attributes are read back as the exporters read them."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from memwatch.export.state import ExportState
from memwatch.flags import Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Event
from memwatch.ring_records import RingDrain
from memwatch.sidecar.live import LiveDetectors
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_format import PHASE_CODES
from memwatch_engine.ring_reader import RingHeader, RingReader

SERVE = PHASE_CODES["serve"]
PREFILL, DECODE = 1, 2
META = {"engine": "vllm", "model": "m", "gpu_name": "NVIDIA H200", "gpu_total_bytes": 141 * 2**30, "pid": 7,
        "device_index": 0, "config": {}, "source": "engine"}
NOW = 1000.0
"""The state's clock: far from this host's monotonic clock, so a time read on the wrong clock shows."""


class Ring:
    """A real ring an engine writes, and the sidecar's reader draining it into a state."""

    def __init__(self, tmp_path: Path, state: ExportState, run_id: str = "drains") -> None:
        self.writer = RingWriter(tmp_path / f"{run_id}-r0.ring", run_id=run_id, meta=META, capacity=256, mode=0o600)
        self.reader = RingReader(tmp_path / f"{run_id}-r0.ring")
        self.state = state
        self.cursor = 0

    def sample(self, step: int, ts_ns: int, kv: tuple[int, int] = (-1, -1), load: tuple[int, int, int] = (-1, -1, -1),
               kind: int = DECODE, tokens: int = 1) -> None:
        """One step's sample: its KV blocks (used, total) and load (running, waiting, needed); -1: not said."""
        self.writer.write_sample(step, ts_ns, SERVE, kind, 0, 10, 20, 30, 40, 50, tokens, *kv, 1,
                                 -1, -1, -1, -1, -1, *load)

    def drain(self) -> None:
        drained = self.reader.drain(self.cursor)
        self.cursor = drained.next_cursor
        header = self.reader.header
        self.state(header, RingDrain(header.run_id, header.rank, drained, self.reader.phase_names))

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


@pytest.fixture
def wired() -> ExportState:
    """A state wired as the sidecar wires it: the detectors' ledger is its terms source (here, one fed nothing)."""
    state = ExportState(clock=lambda: NOW)
    state.set_terms_source(LiveDetectors().last_terms)
    return state


def test_a_drain_keeps_its_last_sample_and_the_kv_view_of_the_last_sample_that_had_one(
        tmp_path: Path, wired: ExportState) -> None:
    ring = Ring(tmp_path, wired)
    try:
        ring.sample(1, 10, kv=(3, 19))
        ring.sample(2, 20, kv=(5, 19))
        ring.sample(3, 30)  # a step without a KV view (a worker's, or a scheduler that could not read its pool)
        ring.drain()
        (series,) = wired.snapshot()
        assert series.last is not None and (series.last.run_id, series.last.rank, series.last.step) == ("drains", 0, 3)
        assert series.last.kv_blocks_total is None
        assert (series.samples, series.kv_blocks) == (3, (5, 19))  # the second sample's, not the last's
        ring.sample(4, 40)
        ring.drain()  # no KV view in this drain: the one seen stays
        assert (series.samples, series.kv_blocks, series.last.step) == (4, (5, 19), 4)
        ring.writer.write_event(4, 41, "preemption", {"count": 2})
        ring.drain()  # events alone: the last sample stays
        assert (series.samples, series.preemptions, series.last.step) == (4, 2, 4)
        ring.sample(5, 50, kv=(0, 0))  # a cache of no blocks yet is a KV view all the same
        ring.sample(6, 60, kv=(7, 19))
        ring.drain()
        assert series.kv_blocks == (7, 19)
        ring.sample(7, 70, kv=(0, 0))
        ring.drain()
        assert series.kv_blocks == (0, 0)
        ring.sample(8, 80, kv=(-1, 19))  # a total without a count of blocks used: that count is not known
        ring.drain()
        assert series.kv_blocks == (None, 19)
    finally:
        ring.close()


def test_the_terms_come_from_the_source_not_from_a_ledger_of_the_state_s_own(tmp_path: Path,
                                                                            wired: ExportState) -> None:
    # The detectors were fed nothing: they have no terms for the rank, so neither has the state, whose records
    # alone would give a ledger terms. Handed typed records, a state with no source computes them itself.
    ring = Ring(tmp_path, wired)
    own = ExportState(clock=lambda: NOW)
    try:
        ring.sample(1, 10, kv=(3, 19))
        ring.drain()
        own(ring.reader.header, RingDrain("drains", 0, ring.reader.drain(0), ring.reader.phase_names))
        assert [s.terms for s in wired.snapshot()] == [None]
        (mine,) = own.snapshot()
        assert isinstance(mine.terms, LedgerTerms)
    finally:
        ring.close()


def test_the_drain_feeds_the_headroom_its_kv_view_load_sizing_and_the_time_it_was_read(
        tmp_path: Path, wired: ExportState) -> None:
    ring = Ring(tmp_path, wired)
    try:
        ring.writer.write_event(0, 5, "config", {"block_size": 16, "max_num_batched_tokens": 2048})
        ring.sample(1, 1_000_000_000, kv=(3, 19), load=(1, 0, 2), kind=PREFILL, tokens=100)
        ring.writer.write_event(1, 1_200_000_000, "request_finished", {"request_id": 0, "output_tokens": 4})
        ring.sample(2, 1_500_000_000, kv=(3, 19), load=(1, 0, 0))  # its one running request finished in it
        ring.sample(3, 3_000_000_000, kv=(0, 19), load=(0, 0, 0))
        ring.drain()
        (series,) = wired.snapshot()
        inputs = series.inputs
        assert (inputs.block_size, inputs.max_batched_tokens, inputs.finished) == (16, 2048, 1)
        assert (inputs.kv_used, inputs.kv_total, inputs.running, inputs.waiting, inputs.needed) == (0, 19, 0, 0, 0)
        assert inputs.seen_at == NOW  # no ring opened: the drain is when it was last seen
        # Step 1 -> 2 is timed (0.5 s: work remained after step 1); step 2 left nothing to do once its request
        # finished, so the 1.5 s to step 3 is an idle spell, not a step.
        assert inputs.steps.expected_s(0, None) == 0.5
    finally:
        ring.close()


def test_an_opened_ring_s_newest_sample_is_read_on_the_state_s_clock_between_drains(
        tmp_path: Path, wired: ExportState) -> None:
    ring = Ring(tmp_path, wired)
    try:
        wired.ring_opened(ring.reader.header, ring.reader)
        ring.sample(1, time.time_ns(), kv=(3, 19), load=(1, 0, 0))
        ring.drain()
        ring.sample(2, time.time_ns(), kv=(9, 19), load=(2, 1, 4))  # written after the drain
        (engine,) = wired.engines(wired.snapshot())
        inputs = wired.snapshot()[0].inputs
        assert (inputs.kv_used, inputs.running, inputs.waiting, inputs.needed) == (9, 2, 1, 4)
        assert inputs.seen_at is not None and NOW - 5 < inputs.seen_at <= NOW  # written just now, on our clock
        assert (engine.labels["run_id"], engine.requests_running, engine.requests_waiting) == ("drains", 2, 1)
        assert engine.age_seconds is not None and 0 <= engine.age_seconds < 5
    finally:
        ring.close()


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_ring_opened_again_closes_the_reading_of_the_first_opening_and_a_finished_one_closes_its_own(
        tmp_path: Path, wired: ExportState) -> None:
    ring = Ring(tmp_path, wired)
    try:
        before = _open_descriptors()
        wired.ring_opened(ring.reader.header, ring.reader)
        assert _open_descriptors() == before + 1  # a descriptor of its own
        wired.ring_opened(ring.reader.header, ring.reader)
        assert _open_descriptors() == before + 1
        wired.finished(ring.reader.header)
        assert _open_descriptors() == before
    finally:
        ring.close()


def test_preemptions_count_what_each_event_says_and_at_least_one_and_ooms_count_one_each() -> None:
    state = ExportState()
    events = [
        ({"count": 3}, 3), ({"count": 1}, 1), ({}, 1), ({"count": 0}, 1), ({"count": -2}, 1), ({"count": "4"}, 1),
        ({"count": 2.5}, 1), (["count", 3], 1), ("3", 1),
    ]
    header = RingHeader(run_id="counts", rank=0, world_size=1, writer_pid=1, writer_start=0, capacity=1 << 16,
                        created_ns=0, meta=META)
    total = 0
    for data, adds in events:
        state(header, [Event("counts", 0, 1, 1, "preemption", data)])
        total += adds
        (series,) = state.snapshot()
        assert series.preemptions == total, data
    state(header, [Event("counts", 0, 2, 2, "oom", {}), Event("counts", 0, 3, 3, "oom", {})])
    assert (series.ooms, series.preemptions) == (2, total)


def test_a_flag_is_counted_then_handed_to_every_listener(tmp_path: Path, wired: ExportState) -> None:
    heard: list[list[Flag]] = [[], []]
    for got in heard:
        wired.add_flag_listener(got.append)
    ring = Ring(tmp_path, wired)
    try:
        ring.sample(1, 10)
        ring.drain()
        flag = Flag("drains", 0, 1, 10, "fragmentation", "warning", "slack grew", {})
        other = Flag("other-run", 0, 1, 10, "fragmentation", "warning", "not ours", {})  # a rank not seen
        wired.on_flag(flag)
        wired.on_flag(other)
        assert heard == [[flag, other], [flag, other]]
        (series,) = wired.snapshot()
        assert dict(series.flags) == {("fragmentation", "warning"): 1}
    finally:
        ring.close()


def test_a_rank_s_attributes_are_a_copy_and_an_unseen_rank_has_its_run_and_rank(tmp_path: Path,
                                                                                wired: ExportState) -> None:
    ring = Ring(tmp_path, wired)
    try:
        ring.sample(1, 10)
        ring.drain()
        attributes: dict[str, Any] = wired.attributes_of("drains", 0)
        assert (attributes["run_id"], attributes["rank"], attributes["engine"], attributes["model"]) == (
            "drains", 0, "vllm", "m")
        attributes["engine"] = "changed"
        assert wired.attributes_of("drains", 0)["engine"] == "vllm"
        assert wired.attributes_of("drains", 1) == {"run_id": "drains", "rank": 1}
        assert wired.attributes_of("other", 0) == {"run_id": "other", "rank": 0}
    finally:
        ring.close()


def test_losses_given_at_construction_are_read_and_a_finished_rank_lingers_exactly_its_linger(tmp_path: Path) -> None:
    now = [100.0]
    state = ExportState(linger=30, clock=lambda: now[0], lost_records=lambda: [("drains", 0, 5), ("gone", 0, 9)])
    ring = Ring(tmp_path, state)
    try:
        ring.sample(1, 10)
        ring.drain()
        assert [s.lost for s in state.snapshot()] == [5]
        state.finished(ring.reader.header)
        now[0] = 130.0  # 30 s after it finished: still published
        assert len(state.snapshot()) == 1
        now[0] = 130.5
        assert state.snapshot() == []
    finally:
        ring.close()
