"""The engine's load in the ring and how the sidecar reads it: what every step carries for the headroom gauges.

Each number is what the step was given or, for the blocks still needed, worked out by hand from
``ceil(end / B) - ceil(now / B)`` per request.
"""

from __future__ import annotations

import os
from pathlib import Path

from memwatch.export.latest_sample import LatestSample
from memwatch.sim import run_scenario
from memwatch.sim.blocks import BlockManager
from memwatch.sim.scheduler import Scheduler
from memwatch.sim.sequence import Sequence
from memwatch_engine import Monitor
from memwatch_engine.load import kv_blocks_needed
from memwatch_engine.probes.base import Probe
from memwatch_engine.ring_format import RECORD_SIZE, SAMPLE_HAS_LOAD, sample_load, sample_slot
from memwatch_engine.ring_reader import RingReader


def _monitor(runtime_dir: Path, run_id: str = "load", capacity: int = 1 << 16) -> Monitor:
    return Monitor(engine="t", runtime_dir=runtime_dir, probe=Probe(), run_id=run_id, spawn_sidecar=False,
                   close_at_exit=False, capacity=capacity)


def _loads(path: Path) -> list[tuple[int, int, int] | None]:
    """The load of every sample in the ring, in order."""
    drained = RingReader(path).drain(0)
    first = int.from_bytes(drained.slots[:8], "little")
    return [sample_load(drained.slots, row[0] - first) for row in drained.samples]


def test_a_step_carries_its_load_and_a_reading_without_one_says_so(runtime_dir: Path) -> None:
    monitor = _monitor(runtime_dir)
    monitor.step("decode", num_seqs=3, num_tokens=3, kv_blocks_used=7, kv_blocks_total=9, requests_running=3,
                 requests_waiting=5, kv_blocks_needed=11)
    monitor.step("decode", num_seqs=3, num_tokens=3)  # an engine that does not say: -1 each, still flagged
    monitor.sample()  # a reading between steps: no load written at all
    monitor.step("prefill", num_seqs=1, num_tokens=None, requests_running=None, requests_waiting=2,
                 kv_blocks_needed=0)  # a None takes the writer's own path, as unknown
    assert _loads(monitor.ring_path) == [(3, 5, 11), (-1, -1, -1), None, (-1, 2, 0)]
    drained = RingReader(monitor.ring_path).drain(0)
    # The flag byte of each sample: bit 1 the load; the drained tuple still has its 21 fields.
    assert [row[2] & SAMPLE_HAS_LOAD for row in drained.samples] == [2, 2, 0, 2]
    assert {len(row) for row in drained.samples} == {21}
    monitor.close()


def test_only_a_slot_flagged_as_carrying_a_load_is_read_for_one() -> None:
    """An older writer's padding (zeros) is never read as a load: bit 1 clear, no load, whatever the bytes."""
    plain = sample_slot(1, 2, 5, 2, 0, 10, 20, 30, 40, 50, 6, 7, 8, 9)
    assert plain[9] == 0 and sample_load(plain, 0) is None
    older = plain[:12] + bytes(4) + plain[16:120] + bytes(8)  # a version 2 writer from before the load
    assert sample_load(older, 0) is None
    loaded = sample_slot(1, 2, 5, 2, 0, 10, 20, 30, 40, 50, 6, 7, 8, 9, requests_waiting=4)
    assert loaded[9] == SAMPLE_HAS_LOAD and sample_load(loaded, 0) == (-1, 4, -1)


def test_blocks_still_needed_by_hand() -> None:
    # 16-token blocks: 20 -> 40 tokens is blocks 2 -> 3 (1 more); 16 -> 16 none; 17 -> 48 is 2 -> 3;
    # a request past its end (max_tokens lowered) needs none, never a negative count.
    assert kv_blocks_needed([(20, 40)], 16) == 1
    assert kv_blocks_needed([(16, 16), (17, 48), (50, 30)], 16) == 0 + 1 + 0
    assert kv_blocks_needed([(1, 4096)], 1) == 4095  # SGLang's pool counts tokens
    assert kv_blocks_needed([], 16) == 0


def test_the_simulated_scheduler_counts_what_its_running_requests_still_need() -> None:
    manager = BlockManager(10, 16)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = Sequence(0, 40, 20), Sequence(1, 40, 20), Sequence(2, 50, 20)
    for seq in (a, b, c):
        scheduler.add(seq)
    seqs, _ = scheduler.schedule()  # A's prefill: A runs, B and C wait
    # A ends at 40 + 20 = 60 tokens: ceil(60/16) = 4 blocks, holds ceil(40/16) = 3.
    assert (len(scheduler.running), len(scheduler.waiting), scheduler.kv_blocks_needed()) == (1, 2, 4 - 3)
    scheduler.postprocess(seqs, True)
    for _ in range(2):
        scheduler.postprocess(*scheduler.schedule())
    # A and B hold 41 tokens (3 blocks) of 60 (4): 1 each; C 51 (4) of 70 (5): 1.
    assert (len(scheduler.running), len(scheduler.waiting), scheduler.kv_blocks_needed()) == (3, 0, 3)


def test_a_simulated_run_records_the_load_on_the_rank_that_schedules(tmp_path: Path) -> None:
    result = run_scenario("clean_chat", runtime_dir=tmp_path, start_ns=1_700_000_000 * 10**9)
    rings = sorted(tmp_path.glob("*.ring"))
    by_rank = {RingReader(path).header.rank: path for path in rings}
    lead = [load for load in _loads(by_rank[0]) if load is not None]
    assert len(lead) == result.steps and all(min(load) >= 0 for load in lead)
    assert lead[-1][1] == 0  # the last step: every request arrived and none waits
    for rank, path in by_rank.items():
        if rank:
            assert {load for load in _loads(path) if load is not None} == {(-1, -1, -1)}


def test_the_newest_sample_is_read_past_events_and_readings_without_a_load(runtime_dir: Path) -> None:
    # The engine's clock (its records' ts_ns) and the sidecar's wall clock are one clock here, held still; the
    # sidecar's own monotonic clock is ``now``.
    wall = [1_000 * 10**9]
    monitor = Monitor(engine="t", runtime_dir=runtime_dir, probe=Probe(), run_id="load", spawn_sidecar=False,
                      close_at_exit=False, capacity=16, clock=lambda: wall[0])
    reader = RingReader(monitor.ring_path)
    now = [10.0]
    latest = LatestSample(reader.fileno(), reader.header.capacity, clock=lambda: now[0], wall=lambda: wall[0])
    assert latest.read() is None and latest.seen_at == 10.0  # nothing stepped yet (the phase events only)
    for step in range(40):  # the 16-slot ring wraps around twice
        monitor.step("decode", num_seqs=1, num_tokens=1, kv_blocks_used=step, kv_blocks_total=100,
                     requests_running=1, requests_waiting=step % 3, kv_blocks_needed=100 - step)
    monitor.event("kv_evictable", {"evictable_tokens": 5})
    monitor.sample()
    now[0], wall[0] = 11.0, wall[0] + 250_000_000  # a scrape 250 ms after those writes
    found = latest.read()
    assert found is not None and (found.kv_used, found.kv_total, found.running, found.waiting, found.needed) == (
        39, 100, 1, 39 % 3, 61)
    # Written 250 ms before the scrape saw it (the newest record's own timestamp), not when the scrape came.
    assert latest.seen_at == 11.0 - 0.25
    now[0] = 12.5
    assert latest.read() == found and latest.seen_at == 10.75  # nothing new: when it was written stands
    latest.close()
    reader.close()
    monitor.close()
    assert latest.read() is None
    assert os.path.exists(monitor.ring_path) and RECORD_SIZE == 128


def test_a_rank_without_a_load_is_aged_by_its_newest_record_and_a_future_stamp_counts_as_now(
        runtime_dir: Path) -> None:
    engine_ns = [5_000 * 10**9]
    monitor = Monitor(engine="t", runtime_dir=runtime_dir, probe=Probe(), run_id="worker", spawn_sidecar=False,
                      close_at_exit=False, capacity=64, clock=lambda: engine_ns[0])
    reader = RingReader(monitor.ring_path)
    sidecar_wall = [engine_ns[0] + 2 * 10**9]  # the sidecar looks 2 s after the engine's write
    latest = LatestSample(reader.fileno(), reader.header.capacity, clock=lambda: 100.0, wall=lambda: sidecar_wall[0])
    monitor.step()  # a TP worker's step: no KV view, no load
    latest.moved()
    assert latest.seen_at == 100.0 - 2.0
    latest.moved()
    assert latest.seen_at == 98.0  # the count did not move: unchanged
    engine_ns[0] += 10 * 10**9  # an engine on a simulated clock, ahead of the sidecar's: written now, not later
    monitor.step()
    latest.moved()
    assert latest.seen_at == 100.0
    latest.close()
    reader.close()
    monitor.close()


def test_the_activation_per_token_is_the_largest_prefill_s_else_the_warmup_s() -> None:
    from memwatch.export.headroom import RankInputs

    inputs = RankInputs()
    assert inputs.activation_per_token(2 << 30) is None  # no prefill, no batch size: unknown
    inputs.take_event("config", {"max_num_batched_tokens": 4096, "block_size": 16})
    assert inputs.block_size == 16
    assert inputs.activation_per_token(2 << 30) == (2 << 30) / 4096  # the warmup's reserve over its batch
    # Ring tuples (SAMPLE_FIELDS): flags 1 (own peak), kind 1 (prefill), allocated 7, peak 8, tokens 12.
    row = [0] * 21

    def prefill(tokens: int, rise: int) -> tuple[int, ...]:
        row[2], row[4], row[7], row[8], row[12], row[14] = 1, 1, 10 << 30, (10 << 30) + rise, tokens, -1
        return tuple(row)

    # 100 tokens rising 60 MiB (fixed buffers dominate) and 4,000 rising 1,000 MiB: the larger one's 256 KiB.
    inputs.take_rows([prefill(100, 60 << 20), prefill(4000, 1000 << 20)], b"", now=1.0)
    assert inputs.activation_per_token(2 << 30) == (1000 << 20) / 4000
    assert inputs.seen_at == 1.0 and inputs.reports is False  # no KV view, no load in those rows


class _Ring:
    """A ring written record by record (samples and one-slot events), stamped ``ts`` ns apart, and a reader of
    its newest sample whose ``clock`` can make the writer write while a read is under way."""

    def __init__(self, runtime_dir: Path, capacity: int) -> None:
        from memwatch_engine.ring import RingWriter

        self.writer = RingWriter(runtime_dir / "ring.bin", run_id="slots", capacity=capacity)
        self.reader = RingReader(runtime_dir / "ring.bin")
        self.now, self.wall, self.during_read = 100.0, 5_000 * 10**9, 0
        self.latest = LatestSample(self.reader.fileno(), capacity, clock=self._clock, wall=lambda: self.wall)

    def _clock(self) -> float:
        if self.during_read:  # the writer moves on between the read of ``published`` and the copy of the slots
            writes, self.during_read = self.during_read, 0
            self.events(writes)
        return self.now

    def sample(self, kv_used: int) -> None:
        self.writer.write_sample(1, self.wall, 5, 2, 0, 0, 0, 0, 0, 0, 1, kv_used, 100, 1, -1, -1, -1, -1, -1,
                                 1, 0, 3)

    def events(self, count: int) -> None:
        for _ in range(count):
            self.writer.write_event(1, self.wall, "x", {})

    def close(self) -> None:
        self.latest.close()
        self.reader.close()
        self.writer.close()


def test_the_newest_sample_is_found_at_any_offset_and_wrap_of_the_ring(runtime_dir: Path) -> None:
    ring = _Ring(runtime_dir, 64)
    for used in range(20):  # 20 slots: the last 16 start at slot 4, no wrap
        ring.sample(used)
    found = ring.latest.read()
    assert found is not None and (found.seq, found.kv_used) == (19, 19)
    for used in range(20, 63):
        ring.sample(used)
    found = ring.latest.read()  # 63 written: the last 16 are slots 47 to 62, up to one short of the end
    assert found is not None and (found.seq, found.kv_used) == (62, 62)
    ring.sample(63)
    ring.sample(64)  # 65 written: slots 49 to 63 and then slot 0
    found = ring.latest.read()
    assert found is not None and (found.seq, found.kv_used) == (64, 64)
    ring.sample(65)
    ring.events(1)  # one slot after the newest sample
    found = ring.latest.read()
    assert found is not None and (found.seq, found.kv_used) == (65, 65)
    ring.close()


def test_slots_the_writer_may_reach_are_not_read(runtime_dir: Path) -> None:
    # 16 slots: 2 kept clear for an event's chunks being written, so of the last 16 only the newest 14 count.
    ring = _Ring(runtime_dir, 16)
    ring.sample(1)
    ring.events(13)
    found = ring.latest.read()
    assert found is not None and found.kv_used == 1  # 14th newest: read
    ring.sample(2)
    ring.events(14)
    assert ring.latest.read() is None  # 15th newest: within the writer's reach
    ring.close()


def test_a_read_the_writer_overtakes_takes_neither_its_slots_nor_their_stamps(runtime_dir: Path) -> None:
    ring = _Ring(runtime_dir, 16)
    ring.sample(1)
    ring.wall += 2 * 10**9  # read 2 s after the write
    ring.during_read = 13  # 13 records written meanwhile: the newest copied slot is the oldest still safe
    found = ring.latest.read()
    assert found is not None and found.kv_used == 1 and ring.latest.seen_at == 98.0
    ring.sample(2)
    ring.wall += 2 * 10**9
    ring.during_read = 14  # one more: even the newest copied slot may be a torn copy
    assert ring.latest.read() is None and ring.latest.seen_at == 100.0  # when the scrape saw it move
    ring.close()


def test_an_unmoved_or_empty_ring_and_a_closed_reader_say_nothing_new(runtime_dir: Path) -> None:
    ring = _Ring(runtime_dir, 16)
    ring.latest.moved()  # nothing written yet
    assert ring.latest.seen_at is None
    ring.sample(1)
    ring.latest.moved()
    assert ring.latest.seen_at == 100.0
    ring.now = 101.0
    ring.latest.moved()  # the count did not move: when it was written stands
    assert ring.latest.seen_at == 100.0
    assert ring.latest.read() is None  # moved() took this count: nothing new, and no sample read before
    ring.close()
    assert ring.latest.read() is None and ring.latest.seen_at == 100.0
    ring.latest.close()  # twice: harmless, and no other descriptor of this process is closed
    os.fstat(1)


def test_a_reader_closed_before_it_read_knows_no_time(runtime_dir: Path) -> None:
    ring = _Ring(runtime_dir, 16)
    ring.sample(1)
    ring.latest.close()
    assert ring.latest.read() is None and ring.latest.seen_at is None
    ring.latest.moved()
    assert ring.latest.seen_at is None
    ring.close()


def test_a_ring_of_four_slots_keeps_no_margin(runtime_dir: Path) -> None:
    ring = _Ring(runtime_dir, 4)  # an eighth of 4 slots is 0: all 4 are read
    ring.sample(1)
    ring.events(3)
    found = ring.latest.read()
    assert found is not None and found.kv_used == 1
    ring.close()


def test_a_reader_on_descriptor_0_reads_and_closes_it(runtime_dir: Path) -> None:
    """A sidecar started with stdin closed gets descriptor 0 for a ring: it is a descriptor like any other."""
    ring = _Ring(runtime_dir, 16)
    ring.latest.close()
    saved = os.dup(0)
    os.close(0)
    try:
        ring.latest = LatestSample(ring.reader.fileno(), 16, clock=lambda: ring.now, wall=lambda: ring.wall)
        assert _open(0)  # the reader's own copy took descriptor 0
        ring.sample(7)
        found = ring.latest.read()
        assert found is not None and found.kv_used == 7 and ring.latest.seen_at == 100.0
        ring.sample(8)
        ring.now = 101.0
        ring.latest.moved()
        assert ring.latest.seen_at == 101.0
        ring.latest.close()
        assert not _open(0)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        ring.close()


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
