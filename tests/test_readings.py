"""What a rank's raw readings say when the ledger cannot: a crash's lead, a run whose end was not seen, a run still
being recorded, and a rank that never sized a KV cache.

Samples are set by hand, one a second from ``START_NS`` (2023-11-14 22:13:20 UTC) on a 16 GiB device, so every
number and every sentence below follows from them; the stored runs' readings are pinned in test_stored_readings.py.
"""

from __future__ import annotations

from memwatch.detectors.detector_set import STARTUP_PHASES
from memwatch.records import Event, Sample
from memwatch.report.readings import (
    CRASH,
    UNSIZED_SENTENCE,
    RankReadings,
    ReadingsWindow,
    crash_ends,
    crash_sentences,
    format_time,
    running_sentence,
    unseen_end_sentence,
)

from stored_runs import START_NS

MiB = 1 << 20
GiB = 1 << 30


def _sample(step: int, phase: str | None = "serve", *, rank: int = 0, alloc: int | None = None,
            peak: int | None = None, reserved: int | None = None, used: int | None = None,
            free: int | None = None) -> Sample:
    return Sample("run-1", rank, step, START_NS + step * 10**9, phase, alloc, peak, reserved, used, free)


def _readings(*samples: Sample, rank: int = 0) -> RankReadings:
    readings = RankReadings(rank)
    for sample in samples:
        readings.add(sample, sample.phase in STARTUP_PHASES)
    return readings


LOAD = _sample(0, "load", alloc=1 * GiB, peak=2 * GiB, reserved=3 * GiB, used=4 * GiB, free=12 * GiB)
SERVE = _sample(1, alloc=2 * GiB, peak=5 * GiB, reserved=4 * GiB, used=6 * GiB, free=10 * GiB)
NO_DRIVER = _sample(2, alloc=1 * GiB, free=9 * GiB)
LOWER = _sample(3, alloc=1 * GiB, peak=3 * GiB, reserved=3 * GiB, used=5 * GiB)


def test_samples_fold_into_their_peaks_the_first_serving_sample_and_the_devices_size() -> None:
    readings = _readings(LOAD, SERVE, NO_DRIVER, LOWER)
    # The peaks never fall, a missing reading leaves them; the device's size is the last used + free known.
    assert (readings.samples, readings.first_serving, readings.last, list(readings.window)) == (
        4, SERVE, LOWER, [LOAD, SERVE, NO_DRIVER, LOWER])
    assert (readings.max_peak_bytes, readings.max_reserved_bytes, readings.max_driver_used_bytes,
            readings.total_bytes) == (5 * GiB, 4 * GiB, 6 * GiB, 16 * GiB)
    first = _readings(_sample(0, peak=None, reserved=2 * GiB, used=None, free=None))
    assert (first.first_serving, first.max_peak_bytes, first.max_reserved_bytes, first.max_driver_used_bytes,
            first.total_bytes) == (first.last, None, 2 * GiB, None, None)


def test_the_last_window_of_a_serving_rank_holds_only_its_serving_samples() -> None:
    readings = _readings(LOAD, SERVE, NO_DRIVER, LOWER)
    window = readings.last_window()
    assert window == ReadingsWindow(1, 3, 2.0, {"driver_free_bytes": 10 * GiB, "non_torch_bytes": 2 * GiB,
                                                "cache_slack_bytes": 2 * GiB, "allocated_bytes": 2 * GiB},
                                    {"driver_free_bytes": None, "non_torch_bytes": 2 * GiB,
                                     "cache_slack_bytes": 2 * GiB, "allocated_bytes": 1 * GiB})
    assert readings.window_samples == 3
    # A rank that went back to a startup phase, or never served, is read over its whole window.
    warmed = _readings(LOAD, SERVE, _sample(2, "warmup", alloc=3 * GiB))
    assert (warmed.last_window().from_step, warmed.window_samples) == (0, 3)
    starting = _readings(LOAD, _sample(4, "cudagraph"))
    assert (starting.first_serving, starting.since_serving()) == (None, None)
    assert (starting.last_window().from_step, starting.last_window().to_step, starting.window_samples) == (0, 4, 2)
    assert RankReadings(0).last_window() is None and RankReadings(0).since_serving() is None


def test_the_window_is_the_last_hundred_samples_and_growth_counts_from_the_first_serving_one() -> None:
    readings = _readings(LOAD, *(_sample(step, alloc=step * MiB) for step in range(1, 105)))
    window, growth = readings.last_window(), readings.since_serving()
    assert (window.from_step, window.to_step, window.seconds, readings.window_samples) == (5, 104, 99.0, 100)
    assert (window.start["allocated_bytes"], window.end["allocated_bytes"]) == (5 * MiB, 104 * MiB)
    assert (growth.from_step, growth.to_step, growth.seconds) == (1, 104, 103.0)
    assert (growth.start["allocated_bytes"], growth.end["allocated_bytes"]) == (1 * MiB, 104 * MiB)


def test_a_window_says_free_memory_from_and_to_and_each_term_by_its_change() -> None:
    window = ReadingsWindow(1, 1_234, 150.0,
                            {"driver_free_bytes": 10 * GiB, "non_torch_bytes": 2 * GiB, "cache_slack_bytes": 2 * GiB,
                             "allocated_bytes": 2 * GiB},
                            {"driver_free_bytes": 9 * GiB, "non_torch_bytes": 2 * GiB + 512 * MiB,
                             "cache_slack_bytes": 1 * GiB, "allocated_bytes": 2 * GiB})
    assert window.sentence("rank 0's last 3 samples") == (
        "rank 0's last 3 samples, steps 1 to 1,234 (2.5 min): free memory 10.0 GiB -> 9.0 GiB, non-PyTorch "
        "+512.0 MiB, cache slack -1.0 GiB, allocated +0 B.")
    # 2.5 s is said to the second, rounded half to even
    unknown = ReadingsWindow(0, 1, 2.5, {**window.start, "driver_free_bytes": None},
                             {**window.end, "non_torch_bytes": None})
    assert unknown.sentence("w") == ("w, steps 0 to 1 (2 s): free memory unknown, non-PyTorch unknown, cache slack "
                                     "-1.0 GiB, allocated +0 B.")


def test_a_rank_without_a_kv_sizing_says_what_its_samples_can() -> None:
    readings = _readings(LOAD, SERVE, NO_DRIVER, LOWER)
    assert readings.unsized_sentences() == [
        f"rank 0: {UNSIZED_SENTENCE}.",
        "rank 0 recorded 4 samples up to step 3: allocator peak 5.0 GiB, reserved at most 4.0 GiB, driver used at most "
        "6.0 GiB of 16.0 GiB; at the end non-PyTorch 2.0 GiB, cache slack 2.0 GiB.",
        "rank 0 since its first serving sample, steps 1 to 3 (2 s): free memory unknown, non-PyTorch "
        "+0 B, cache slack +0 B, allocated -1.0 GiB."]
    # Nothing known of the device, no growth from a single serving sample, and nothing but the lack of a sizing
    # from a rank without samples.
    lone = _readings(_sample(7, rank=2, alloc=GiB, reserved=2 * GiB), rank=2)
    assert lone.unsized_sentences() == [
        f"rank 2: {UNSIZED_SENTENCE}.",
        "rank 2 recorded 1 samples up to step 7: allocator peak unknown, reserved at most 2.0 GiB, driver used at most "
        "unknown; at the end non-PyTorch unknown, cache slack 1.0 GiB."]
    unread = _readings(_sample(8, used=3 * GiB, free=GiB), rank=2)
    assert unread.unsized_sentences()[1].endswith("of 4.0 GiB; at the end non-PyTorch unknown, cache slack unknown.")
    assert RankReadings(5).unsized_sentences() == [f"rank 5: {UNSIZED_SENTENCE}."]
    cpu = _readings(SERVE, rank=1)
    cpu.device_note = "its device is a CPU: no allocator or driver readings"
    assert cpu.unsized_sentences() == ["rank 1: its device is a CPU: no allocator or driver readings."]
    assert UNSIZED_SENTENCE == ("no KV sizing was recorded (no kv_allocated event), so the budget, headroom, "
                                "residual and OOM margin cannot be known")


def test_a_ranks_readings_as_json() -> None:
    readings = _readings(LOAD, SERVE, LOWER)
    end = {"driver_free_bytes": None, "non_torch_bytes": 2 * GiB, "cache_slack_bytes": 2 * GiB,
           "allocated_bytes": 1 * GiB}
    served = {"from_step": 1, "to_step": 3, "seconds": 2.0,
              "start": {"driver_free_bytes": 10 * GiB, "non_torch_bytes": 2 * GiB, "cache_slack_bytes": 2 * GiB,
                        "allocated_bytes": 2 * GiB}, "end": end}
    assert readings.to_dict() == {
        "rank": 0, "samples": 3, "last_step": 3, "last_ts_ns": START_NS + 3 * 10**9, "last_phase": "serve",
        "max_peak_bytes": 5 * GiB, "max_reserved_bytes": 4 * GiB, "max_driver_used_bytes": 6 * GiB,
        "total_bytes": 16 * GiB, "last": end, "last_window": served, "since_serving": served}
    assert RankReadings(3).to_dict() == {
        "rank": 3, "samples": 0, "last_step": None, "last_ts_ns": None, "last_phase": None, "max_peak_bytes": None,
        "max_reserved_bytes": None, "max_driver_used_bytes": None, "total_bytes": None, "last": None,
        "last_window": None, "since_serving": None}


# -- how a run ended ---------------------------------------------------------------------------------------------

def _rank_ending(rank: int, step: int, free: int, *, phase: str | None = "serve") -> RankReadings:
    """A rank serving from step ``step - 1`` to ``step`` on a 16 GiB device, ``free`` left at the end."""
    return _readings(_sample(step - 1, rank=rank, alloc=2 * GiB, reserved=3 * GiB, used=16 * GiB - free - GiB,
                             free=free + GiB),
                     _sample(step, phase, rank=rank, alloc=2 * GiB, reserved=3 * GiB, used=16 * GiB - free, free=free),
                     rank=rank)


def test_a_crash_is_led_by_where_it_stopped_and_each_ranks_last_window_and_free_memory() -> None:
    # Rank 0 stopped last (step 20, at 22:13:40): with 100 MiB of 16 GiB free (under 2 %, 327.7 MiB) it ran dry;
    # rank 1, 4 GiB free at step 10, went down with it.
    ranks = [_rank_ending(0, 20, 100 * MiB), _rank_ending(1, 10, 4 * GiB)]
    assert crash_sentences("crashed", ranks, START_NS + 5 * 10**9) == [
        "the run crashed: its process ended without recording how; its last record is rank 0 step 20 (serve) at "
        "2023-11-14 22:13:40.000 UTC, 15 s after it started.",
        "rank 0's last 2 samples, steps 19 to 20 (1 s): free memory 1.1 GiB -> 100.0 MiB, non-PyTorch +1.0 GiB, "
        "cache slack +0 B, allocated +0 B.",
        "rank 0 had only 100.0 MiB free at its last sample: a failed GPU allocation is the likely cause.",
        "rank 1's last 2 samples, steps 9 to 10 (1 s): free memory 5.0 GiB -> 4.0 GiB, non-PyTorch +1.0 GiB, "
        "cache slack +0 B, allocated +0 B.",
        "rank 1 still had 4.0 GiB free at its last sample: it likely stopped with rank 0, whose device was nearly "
        "full."]
    # What an account of its own says already is not said twice.
    assert crash_sentences("crashed", ranks, None, explained=frozenset({0}), windowed=frozenset({1}))[1:] == [
        "rank 0's last 2 samples, steps 19 to 20 (1 s): free memory 1.1 GiB -> 100.0 MiB, non-PyTorch +1.0 GiB, "
        "cache slack +0 B, allocated +0 B.",
        "rank 1 still had 4.0 GiB free at its last sample: it likely stopped with rank 0, whose device was nearly "
        "full."]
    # A start one nanosecond before the last record is 0 s before it; one at it says nothing.
    assert crash_sentences("crashed", ranks, START_NS + 20 * 10**9 - 1)[0].endswith(" UTC, 0 s after it started.")
    assert crash_sentences("crashed", ranks, START_NS + 20 * 10**9)[0].endswith(" 22:13:40.000 UTC.")


def test_a_crash_with_room_left_or_none_at_all_says_which() -> None:
    # 327.68 MiB is 2 % of 16 GiB: from there on the device counts as having had room.
    roomy = _rank_ending(0, 3, 16 * GiB // 50, phase=None)
    lead = crash_sentences("error", [roomy], START_NS + 3 * 10**9)
    assert lead[0] == "the run stopped with an error; its last record is rank 0 step 3 at 2023-11-14 22:13:23.000 UTC."
    assert lead[2] == ("rank 0 still had 327.7 MiB free at its last sample: the readings do not point to GPU memory "
                       "(look at how the process ended: a signal, the host's OOM killer, a fault).")
    dry = crash_sentences("crashed", [RankReadings(4), _rank_ending(0, 3, 0)], START_NS + 4 * 10**9)
    assert dry[0].endswith("its last record is rank 0 step 3 (serve) at 2023-11-14 22:13:23.000 UTC.")
    assert dry[2:] == ["rank 0 had no memory free at its last sample: a failed GPU allocation is the likely cause."]
    assert len(crash_sentences("crashed", [_rank_ending(0, 3, 16 * GiB // 50 - 1)], None)) == 3
    # Without the device's size, only the window is said.
    unknown = _readings(_sample(0, alloc=GiB, free=GiB), _sample(1, alloc=GiB, free=0))
    assert len(crash_sentences("crashed", [unknown], None)) == 2
    assert crash_sentences("crashed", [RankReadings(0)], None) == ["the run crashed before recording any sample."]
    assert crash_sentences("error", [], None) == ["the run stopped with an error before recording any sample."]


def test_a_run_whose_end_was_not_seen_or_is_still_being_recorded_says_its_last_record() -> None:
    ranks = [_rank_ending(0, 12, GiB), _rank_ending(1, 8, GiB), RankReadings(2)]
    assert unseen_end_sentence("detached", ranks) == (
        "recording was turned off (detached) after rank 0 step 12 at 2023-11-14 22:13:32.000 UTC while the process "
        "went on: how the run ended was not recorded.")
    assert unseen_end_sentence("exited", ranks) == (
        "the process exited after rank 0 step 12 at 2023-11-14 22:13:32.000 UTC; it was watched from outside, so its "
        "exit code is unknown (only its parent process can collect it).")
    assert unseen_end_sentence("exited", [RankReadings(0)]) == (
        "the process exited; it was watched from outside, so its exit code is unknown (only its parent process can "
        "collect it).")
    assert running_sentence([_rank_ending(0, 1_500, GiB), *ranks]) == (
        "the run is still being recorded: what follows is as of its last record stored (rank 0 step 1,500 at "
        "2023-11-14 22:38:20.000 UTC).")
    assert running_sentence([RankReadings(0)]) == "the run is still being recorded: what follows is as of its last " \
                                                   "record stored."


def test_a_records_time_is_said_in_utc_to_the_millisecond() -> None:
    assert format_time(START_NS + 1_234_567_890) == "2023-11-14 22:13:21.234 UTC"
    assert format_time(START_NS + 5_999_999) == "2023-11-14 22:13:20.005 UTC"
    assert format_time(START_NS + 1_000_000) == "2023-11-14 22:13:20.001 UTC"
    assert format_time(0) == "1970-01-01 00:00:00.000 UTC"


def test_each_rank_that_died_ends_at_its_last_sample() -> None:
    readings = {0: _rank_ending(0, 10, 4 * GiB), 1: _rank_ending(1, 20, 0), 2: RankReadings(2),
                3: _readings(_sample(5, rank=3, free=GiB), rank=3)}
    ends = crash_ends(readings, {1, 2, 3, 7})
    assert ends == {
        1: Event("run-1", 1, 20, START_NS + 20 * 10**9, CRASH, {"driver_free_bytes": 0, "total_bytes": 16 * GiB}),
        3: Event("run-1", 3, 5, START_NS + 5 * 10**9, CRASH, {"driver_free_bytes": GiB, "total_bytes": None})}
    assert list(ends) == [1, 3] and CRASH == "crash"
