"""A stored run's raw readings, read through its one model, are what its rows hold: the counts, peaks and last
samples below are selected with SQL of the test's own from the store the collector wrote."""

from __future__ import annotations

import sqlite3
from itertools import pairwise
from pathlib import Path

from memwatch.detectors.detector_set import STARTUP_PHASES
from memwatch.records import SAMPLE_COLUMNS, Event, Sample
from memwatch.report.readings import RankReadings
from memwatch.report.stored import stored_readings, stored_records
from memwatch.store import open_store
from memwatch.store.run_model import WINDOW_STEPS, load_run

from processes import query
from stored_runs import store_attached_run, store_scenario

GiB = 1 << 30
COLUMNS = ", ".join(("r.run_id", *(f"s.{column}" for column in SAMPLE_COLUMNS[1:])))


def _samples(db_path: Path, rank: int) -> list[Sample]:
    return [Sample.from_row(row) for row in query(db_path, f"SELECT {COLUMNS} FROM sample_rows s JOIN runs r "
                                                           "USING (run_key) WHERE s.rank = ? ORDER BY s.ts_ns, s.seq",
                                                           (rank,))]


def test_a_crashed_runs_readings_are_its_stored_samples(runtime_dir: Path, db_path: Path) -> None:
    # non_torch_leak_tp2: two ranks, each leaking outside PyTorch until its process dies (a crashed run).
    run_id = store_scenario("non_torch_leak_tp2", runtime_dir, db_path, live=True)
    model = load_run(open_store(db_path, readonly=True), run_id)
    readings = stored_readings(model)
    assert (model.run.status, sorted(readings)) == ("crashed", [0, 1])
    for rank, rank_readings in readings.items():
        samples = _samples(db_path, rank)
        [(count, peak, reserved, used)] = query(db_path, "SELECT count(*), max(peak_bytes), max(reserved_bytes), "
                                                         "max(driver_used_bytes) FROM samples WHERE rank = ?", (rank,))
        last = samples[-1]
        assert (rank_readings.rank, rank_readings.samples, rank_readings.max_peak_bytes,
                rank_readings.max_reserved_bytes, rank_readings.max_driver_used_bytes) == (
            rank, count, peak, reserved, used)
        assert len(samples) > WINDOW_STEPS and list(rank_readings.window) == samples[-WINDOW_STEPS:]
        assert rank_readings.last == last
        assert rank_readings.total_bytes == last.driver_used_bytes + last.driver_free_bytes
        assert rank_readings.first_serving == next(s for s in samples if s.phase not in STARTUP_PHASES)
        assert rank_readings.device_note is None
        # The same readings as a fold over the run's samples, as a replay of its records makes them.
        folded = RankReadings(rank)
        for sample in samples:
            folded.add(sample, sample.phase in STARTUP_PHASES)
        assert rank_readings.to_dict() == folded.to_dict()
        assert rank_readings.last_window().end["driver_free_bytes"] == last.driver_free_bytes


def test_a_runs_records_are_its_samples_and_events_events_first_at_equal_times(runtime_dir: Path,
                                                                             db_path: Path) -> None:
    run_id = store_scenario("demo", runtime_dir, db_path)
    run, records = stored_records(open_store(db_path, readonly=True), run_id[:8])
    assert run.run_id == run_id
    [(samples,)] = query(db_path, "SELECT count(*) FROM samples")
    [(events,)] = query(db_path, "SELECT count(*) FROM events")
    assert sum(isinstance(r, Sample) for r in records) == samples and len(records) == samples + events
    times = [r.ts_ns for r in records]
    assert times == sorted(times)
    for before, after in pairwise(records):
        if before.ts_ns == after.ts_ns:  # never a sample before an event of the same time
            assert not (isinstance(before, Sample) and isinstance(after, Event))


def test_a_cpu_runs_ranks_carry_its_probes_note(tmp_path: Path) -> None:
    db_path = tmp_path / "m.db"
    run_id = store_attached_run(db_path)  # three seconds on a 24 GiB GPU: 5, 6 then 7 GiB used
    gpu = stored_readings(load_run(open_store(db_path, readonly=True), run_id))[0]
    assert (gpu.device_note, gpu.samples, gpu.last.step, gpu.total_bytes, gpu.max_driver_used_bytes) == (
        None, 3, 2, 24 * GiB, 7 * GiB)
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE ranks SET gpu_name = 'CPU', probe_unavailable = 'no CUDA device' WHERE run_id = ?",
                     (run_id,))
    cpu = stored_readings(load_run(open_store(db_path, readonly=True), run_id))[0]
    assert cpu.device_note == "no CUDA device"
    assert cpu.unsized_sentences() == ["rank 0: no CUDA device."]


def test_a_summarised_rank_without_samples_has_no_last_sample(runtime_dir: Path, db_path: Path) -> None:
    """A rank the sidecar summarised before it recorded any sample (it died loading): its readings are empty."""
    from memwatch.detectors.summary import RankSummary
    from memwatch.store.summaries import UPSERT_SUMMARY, config_key, summary_params

    run_id = store_scenario("demo", runtime_dir, db_path, live=True)
    with sqlite3.connect(db_path) as conn:
        conn.execute(UPSERT_SUMMARY, summary_params(run_id, RankSummary(1), True, config_key(None)))
    model = load_run(open_store(db_path, readonly=True), run_id)
    assert model.from_summaries and sorted(model.summaries) == [0, 1]
    readings = stored_readings(model)
    empty = readings[1]
    assert (empty.samples, empty.last, empty.total_bytes, list(empty.window), empty.first_serving) == (
        0, None, None, [], None)
    assert readings[0].last.step == query(db_path, "SELECT max(step) FROM sample_rows")[0][0]
