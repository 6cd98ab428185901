"""What one drain of a ring stores, in-process: a real ring written by a Monitor, its real reader, and the
batch committed by the real writer into a real SQLite store."""

from __future__ import annotations

import itertools
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memwatch.ring_records import RingDrain
from memwatch.sidecar.drain_batch import drain_batch
from memwatch.sidecar.ring_state import RingState
from memwatch.sidecar.run_rows import register
from memwatch.store import open_store
from memwatch.store.writer import Batch, StoreWriter
from memwatch_engine import Monitor
from memwatch_engine.ring_reader import Drained, RingReader

from probes import ScriptedProbe

HEAD = 100, 150, 200, 1000, 9000
"""ScriptedProbe's reading: allocated, peak, reserved, driver used, driver free."""


@pytest.fixture
def monitor(runtime_dir: Path) -> Iterator[Monitor]:
    """A 16-slot ring whose clock reads 1000, 2000, 3000, … ns, one tick per record."""
    tick = itertools.count(1)
    monitor = Monitor(engine="test", model="tiny", runtime_dir=runtime_dir, probe=ScriptedProbe(),
                      spawn_sidecar=False, run_id="run1", rank=0, world_size=1, clock=lambda: 1000 * next(tick),
                      config={"block_size": 16}, capacity=16)
    yield monitor
    monitor.close()


def _state(monitor: Monitor) -> RingState:
    assert monitor.ring_path is not None
    reader = RingReader(monitor.ring_path)
    return RingState(monitor.ring_path, monitor.ring_path.name, reader, 0, 0)


def _keys(known: dict[str, int]) -> tuple[Callable[[str], int | None], list[str]]:
    """A run-key lookup that remembers every run it was asked about."""
    asked: list[str] = []

    def run_key(run_id: str) -> int | None:
        asked.append(run_id)
        return known.get(run_id)
    return run_key, asked


def _commit(db_path: Path, state: RingState, batch: Batch) -> None:
    """The run registered as the collector does, then the drain's batch, in one real writer."""
    writer = StoreWriter(open_store(db_path))
    writer.start()
    try:
        writer.submit(Batch(statements=register(state.header)))
        writer.submit(batch)
        assert writer.flush(timeout=30)
    finally:
        writer.close()


def _rows(db_path: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_events_samples_and_the_config_they_patch_are_stored_as_the_ring_holds_them(
        monitor: Monitor, db_path: Path) -> None:
    for _ in range(2):
        monitor.sample()                           # seq 0, 1 at 1000, 2000 ns
    monitor.set_config(gpu_memory_utilization=0.9)  # seq 2 at 3000 ns
    monitor.sample()                               # seq 3 at 4000 ns
    state = _state(monitor)
    run_key, asked = _keys({"run1": 1})
    drained = state.reader.drain(0)
    batch = drain_batch(state, drained, run_key, [])
    assert batch.events == [("run1", 0, 0, 3000, "config", '{"gpu_memory_utilization": 0.9}')]
    patch = "UPDATE runs SET config = json_patch(config, ?) WHERE run_id = ?"
    assert batch.statements == [(patch, ('{"gpu_memory_utilization": 0.9}', "run1"))]  # before it is committed
    assert batch.set_aside == [] and batch.flags == []
    assert [rows for _, rows in batch.ring_samples] == [drained.samples]
    assert [sample[6] for sample in drained.samples] == [1000, 2000, 4000]
    assert state.run_key == 1 and asked == ["run1"]  # learnt once the run's row is there
    assert state.last_ts_ns == 4000                  # the newest record: the last sample
    assert state.end_status is None and state.saw_oom is False
    _commit(db_path, state, batch)
    assert _rows(db_path, "SELECT step, ts_ns, allocated_bytes, peak_bytes, reserved_bytes, driver_used_bytes,"
                          " driver_free_bytes FROM samples ORDER BY ts_ns") == [
        (0, ts, *HEAD) for ts in (1000, 2000, 4000)]
    assert _rows(db_path, "SELECT run_id, rank, step, ts_ns, kind, data FROM events") == batch.events
    config = json.loads(_rows(db_path, "SELECT config FROM runs WHERE run_id = 'run1'")[0][0])
    assert config == {"block_size": 16, "gpu_memory_utilization": 0.9}


def test_the_run_key_is_asked_for_until_it_is_known_and_never_after(monitor: Monitor) -> None:
    state = _state(monitor)
    unknown, asked = _keys({})
    monitor.sample()
    drained = state.reader.drain(0)
    drain_batch(state, drained, unknown, [])
    assert state.run_key is None and asked == ["run1"]  # not registered yet: the next drain asks again
    known, asked = _keys({"run1": 5})
    monitor.sample()
    drained = state.reader.drain(drained.next_cursor)
    drain_batch(state, drained, known, [])
    assert state.run_key == 5 and asked == ["run1"]
    monitor.sample()
    drain_batch(state, state.reader.drain(drained.next_cursor), known, [])
    assert state.run_key == 5 and asked == ["run1"]  # known: never looked up again
    monitor.event("note")
    drained = state.reader.drain(0)
    fresh = _state(monitor)
    drain_batch(fresh, Drained([], drained.events[-1:], [], 4, 0), known, [])
    assert fresh.run_key is None and asked == ["run1"]  # a drain without samples needs no key


def test_run_end_sets_the_rank_s_end_ok_unless_it_says_otherwise_and_oom_marks_it(monitor: Monitor) -> None:
    state = _state(monitor)
    monitor.event("run_end")                       # an end with no status is an ok end
    drained = state.reader.drain(0)
    batch = drain_batch(state, drained, _keys({})[0], [])
    assert state.end_status == "ok" and state.saw_oom is False
    assert batch.events == [("run1", 0, 0, 1000, "run_end", "{}")] and batch.statements == []
    monitor.event("run_end", {"status": "failed"})
    monitor.oom(requested_bytes=4096)              # a last sample, then the oom event
    drained = state.reader.drain(drained.next_cursor)
    batch = drain_batch(state, drained, _keys({})[0], [])
    assert state.end_status == "failed" and state.saw_oom is True
    assert [(event[3], event[4]) for event in batch.events] == [(2000, "run_end"), (4000, "oom")]
    assert batch.statements == []
    assert state.last_ts_ns == 4000                # the oom event, after the sample at 3000


def test_undecodable_records_are_set_aside_whole_with_no_time_when_it_is_zero(monitor: Monitor,
                                                                              db_path: Path) -> None:
    state = _state(monitor)
    state.last_ts_ns = 9000
    bad = [(5, 0, "bad type byte", b"\x07" * 128), (6, 7000, "undecodable event", b"\x02" * 128)]
    batch = drain_batch(state, Drained([], [], bad, 7, 0), _keys({})[0], [])
    assert batch.set_aside == [("run1", 0, 5, None, "bad type byte", b"\x07" * 128),
                               ("run1", 0, 6, 7000, "undecodable event", b"\x02" * 128)]
    assert batch.events == [] and batch.ring_samples == []
    assert state.last_ts_ns == 9000                # nothing timed was stored: where it stood
    state.last_ts_ns = 0
    drain_batch(state, Drained([], [], bad, 7, 0), _keys({})[0], [])
    assert state.last_ts_ns == 0
    _commit(db_path, state, batch)
    assert _rows(db_path, "SELECT run_id, rank, seq, ts_ns, reason, raw FROM set_aside ORDER BY seq") == [
        tuple(row) for row in batch.set_aside]


def test_overwritten_samples_become_one_event_from_the_last_record_stored_to_the_first_read(
        monitor: Monitor, db_path: Path) -> None:
    state = _state(monitor)
    for _ in range(3):
        monitor.sample()                           # seq 0-2 at 1000-3000 ns
    drained = state.reader.drain(0)
    drain_batch(state, drained, _keys({})[0], [])
    assert state.last_ts_ns == 3000
    for _ in range(30):
        monitor.step("decode")                     # seq 3-32 at 4000-33000 ns, steps 1-30
    # 16 slots less a margin of 2: the reader keeps the newest 14 (seq 19-32), 16 were overwritten
    drained = state.reader.drain(drained.next_cursor)
    assert drained.lost == 16 and len(drained.samples) == 14
    batch = drain_batch(state, drained, _keys({})[0], [])
    lost = {"count": 16, "from_ts_ns": 3000, "to_ts_ns": 20000}
    assert batch.events == [("run1", 0, 17, 20000, "samples_lost", json.dumps(lost))]
    assert state.last_ts_ns == 33000
    _commit(db_path, state, batch)
    stored = _rows(db_path, "SELECT step, ts_ns, kind, data FROM events")
    assert stored == [(17, 20000, "samples_lost", json.dumps(lost))]
    assert _rows(db_path, "SELECT min(step), max(step), count(*) FROM samples") == [(17, 30, 14)]


def test_a_loss_with_only_events_read_ends_at_the_first_event_and_with_nothing_read_where_it_stood(
        monitor: Monitor) -> None:
    state = _state(monitor)
    monitor.event("note", {"n": 1})                # seq 0 at 1000 ns
    monitor.event("note", {"n": 2})                # seq 1 at 2000 ns
    events = state.reader.drain(0).events
    batch = drain_batch(state, Drained([], events, [], 10, 8), _keys({})[0], [])
    assert batch.events[-1] == ("run1", 0, None, 1000, "samples_lost",
                                json.dumps({"count": 8, "from_ts_ns": None, "to_ts_ns": 1000}))
    assert len(batch.events) == 3
    assert state.last_ts_ns == 2000                # the newest event
    batch = drain_batch(state, Drained([], [], [], 13, 3), _keys({})[0], [])
    assert batch.events == [("run1", 0, None, 2000, "samples_lost",
                              json.dumps({"count": 3, "from_ts_ns": 2000, "to_ts_ns": 2000}))]
    assert state.last_ts_ns == 2000


class _Observer:
    """An observer as the collector's are: called with the ring's header and what it reads, it answers flags."""

    def __init__(self, **kinds: bool) -> None:
        self.__dict__.update(kinds)
        self.given: list[Any] = []

    def __call__(self, header: Any, given: Any) -> list[tuple[Any, ...]]:
        self.given.append(given)
        return [(header.run_id, header.rank, 0, 1, type(self).__name__, "info", str(len(self.given)), "{}")]


class _Summary(_Observer):
    def statements(self, header: Any) -> list[tuple[str, tuple[Any, ...]]]:
        return [("UPDATE ranks SET status = status WHERE run_id = ?", (header.run_id,))]


def test_every_observer_gets_what_it_reads_and_adds_its_flags_and_statements(monitor: Monitor) -> None:
    monitor.sample()                               # seq 0 at 1000 ns
    monitor.event("config", {"block_size": 32})    # seq 1 at 2000 ns
    state = _state(monitor)
    drained = state.reader.drain(0)
    whole, events, records = _Observer(takes_drain=True), _Observer(events_only=True), _Summary()
    plain = _Observer(takes_drain=False, events_only=False)
    batch = drain_batch(state, drained, _keys({})[0], [whole, events, records, plain])
    (drain,) = whole.given
    assert isinstance(drain, RingDrain) and drain.drained is drained and drain.names is state.reader.phase_names
    assert (drain.run_id, drain.rank) == ("run1", 0)
    assert [(event.kind, event.ts_ns) for event in events.given[0]] == [("config", 2000)]
    assert [type(record).__name__ for record in records.given[0]] == ["Sample", "Event"]
    assert [type(record).__name__ for record in plain.given[0]] == ["Sample", "Event"]
    assert [flag[4] for flag in batch.flags] == ["_Observer", "_Observer", "_Summary", "_Observer"]
    assert batch.statements == [
        ("UPDATE runs SET config = json_patch(config, ?) WHERE run_id = ?", ('{"block_size": 32}', "run1")),
        ("UPDATE ranks SET status = status WHERE run_id = ?", ("run1",)),
    ]


def test_records_stamped_before_their_ring_start_the_run_and_the_rank_there(runtime_dir: Path, db_path: Path) -> None:
    """A simulator's clock, or records kept while the engine waited for its directory, can predate the ring: the
    run starts at its first record, once; a clock a day off leaves the ring's time (the fixture's 1000 ns stamps)."""
    before_ring = time.time_ns() - 5_000_000  # 5 ms before the ring is made
    tick = itertools.count(1)
    monitor = Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False,
                      run_id="run1", rank=0, world_size=1, clock=lambda: before_ring + 1000 * next(tick), capacity=16)
    try:
        monitor.set_config(block_size=16)  # seq 0 at before_ring + 1000: the first record
        monitor.sample()                   # seq 1 at before_ring + 2000
        state = _state(monitor)
        assert state.header.created_ns > before_ring + 5_000_000 - 1  # the ring is younger than its records
        batch = drain_batch(state, state.reader.drain(0), _keys({})[0], [])
        first = before_ring + 1000
        assert batch.statements[1:] == [
            ("UPDATE runs SET started_ns = min(started_ns, ?) WHERE run_id = ?", (first, "run1")),
            ("UPDATE ranks SET started_ns = min(started_ns, ?) WHERE run_id = ? AND rank = ?", (first, "run1", 0))]
        assert state.started_ns == first
        _commit(db_path, state, batch)
        assert _rows(db_path, "SELECT started_ns FROM runs") == [(first,)]
        assert _rows(db_path, "SELECT rank, started_ns FROM ranks") == [(0, first)]
        monitor.sample()  # later than the start already stored: nothing more to move
        assert drain_batch(state, state.reader.drain(2), _keys({})[0], []).statements == []
    finally:
        monitor.close()


@pytest.mark.parametrize(("before_ns", "moved"), [(24 * 3600 * 10**9, True), (24 * 3600 * 10**9 + 1, False)])
def test_a_record_stamped_more_than_a_day_before_its_ring_leaves_the_rings_time(runtime_dir: Path, db_path: Path,
                                                                             before_ns: int, moved: bool) -> None:
    created: list[int] = []  # the ring's time, known once it is made (the Monitor reads its clock only to record)
    monitor = Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False,
                      run_id="run1", rank=0, world_size=1, clock=lambda: created[0] - before_ns, capacity=16)
    try:
        state = _state(monitor)
        created.append(state.header.created_ns)
        monitor.sample()
        batch = drain_batch(state, state.reader.drain(0), _keys({})[0], [])
        assert len(batch.statements) == (2 if moved else 0) and state.started_ns == (created[0] - before_ns) * moved
        _commit(db_path, state, batch)
        assert _rows(db_path, "SELECT started_ns FROM runs") == [(created[0] - before_ns if moved else created[0],)]
    finally:
        monitor.close()


def test_a_drains_statement_is_made_once_per_shape_and_again_for_a_run_key_or_a_new_phase(monitor: Monitor) -> None:
    monitor.sample()
    monitor.sample()
    state = _state(monitor)
    first = state.reader.drain(0)
    sql = state.sample_insert(first.slots)
    assert state.sample_insert(first.slots) is sql  # the same shape: the statement made once
    assert "VALUES ((SELECT run_key FROM runs WHERE run_id = 'run1'), 0, " in sql  # no key known yet
    state.learn_run_key(7)
    keyed = state.sample_insert(first.slots)
    assert keyed is not sql and "VALUES (7, 0, " in keyed and "'mycustom'" not in keyed
    with monitor.phase("mycustom"):  # a phase named since: the next statement must know its name
        monitor.sample()
    later = state.reader.drain(2)
    phased = state.sample_insert(later.slots)
    assert "'mycustom'" in phased and "VALUES (7, 0, " in phased
    again = state.sample_insert(first.slots)  # the old shape is made again, knowing the new phase too
    assert again is not keyed and "VALUES (7, 0, " in again and state.sample_insert(first.slots) is again
