"""Which ledger term grew before an out-of-memory, how another process's jump is told from a leak beside it, and the
last window, over serving points set by hand (one a second from step 0) so that every number follows from them;
the same search over a stored run is the last test."""

from __future__ import annotations

from pathlib import Path

from memwatch.detectors.summary import ServingPoint
from memwatch.records import Event
from memwatch.report import explain_run
from memwatch.report.growth import (
    OutsideSplit,
    TermGrowth,
    WindowChange,
    capital,
    last_window,
    split_outside,
    term_growth,
    term_growths,
    window_sentence,
)
from memwatch.report.points import ListPoints
from memwatch.store import open_store

from stored_runs import store_scenario

MiB = 1 << 20
GiB = 1 << 30
NON_TORCH = "non-PyTorch memory"


def _point(step: int, non_torch: int | None = GiB, slack: int | None = 100 * MiB, allocated: int | None = 2 * GiB,
           free: int | None = None, margin: int | None = None) -> ServingPoint:
    return ServingPoint(step, step * 10**9, non_torch, slack, allocated, free, margin, None, None)


def _oom(step: int) -> Event:
    return Event("r", 0, step, step * 10**9, "oom", {})


def _grown(non_torch: dict[int, int], last: int = 79, **terms: dict[int, int]) -> ListPoints:
    """Points from step 0 to ``last``; each term holds its value from each step given on (non-PyTorch from 1 GiB)."""
    def at(changes: dict[int, int], step: int, start: int) -> int:
        return next((changes[s] for s in sorted(changes, reverse=True) if s <= step), start)
    return ListPoints([_point(step, at(non_torch, step, GiB), at(terms.get("slack", {}), step, 100 * MiB),
                              at(terms.get("allocated", {}), step, 2 * GiB)) for step in range(last + 1)])


def test_terms_that_grew_beyond_their_allowance_most_first_each_from_its_onset() -> None:
    # Non-PyTorch: 1 GiB, 512 KiB over it at step 10 (within the tolerance: still level), then 8 MiB a step from
    # step 11 to 40. Cache slack: 100 MiB, allowed the 200 MiB activation, 400 MiB in one step at 20. Allocated:
    # 63 MiB more, under the 64 MiB a growth counts from.
    non_torch = {10: GiB + 512 * 1024, **{step: GiB + (step - 10) * 8 * MiB for step in range(11, 41)}}
    points = _grown(non_torch, last=40, slack={20: 400 * MiB}, allocated={30: 2 * GiB + 63 * MiB})
    oom = _oom(41)
    leak = TermGrowth("non_torch_bytes", NON_TORCH, GiB + 512 * 1024, GiB + 240 * MiB, 240 * MiB - 512 * 1024, 10,
                      31, 31.0, jump=False)
    cache = TermGrowth("cache_slack_bytes", "the allocator's cache slack (reserved but unallocated)", 100 * MiB,
                       400 * MiB, 300 * MiB, 19, 22, 22.0, jump=True)
    # 240 MiB beyond an allowance of nothing, then 400 − (100 + 200) = 100 MiB
    assert term_growths(points, 200 * MiB, oom) == [leak, cache]
    assert term_growth(points, 200 * MiB, oom) == leak
    # Allowed the 300 MiB it grew, the cache did not grow.
    assert term_growths(points, 300 * MiB, oom) == [leak]


def test_a_growth_counts_from_64_mib_and_is_a_jump_within_ten_steps() -> None:
    # Allocated grows by exactly 64 MiB, reaching 90 % of it 10 steps after its onset at step 20: a jump.
    steps = {21: 2 * GiB + 10 * MiB, 30: 2 * GiB + 58 * MiB, 31: 2 * GiB + 64 * MiB}
    [growth] = term_growths(_grown({}, last=40, allocated=steps), 0, _oom(41))
    assert (growth.term, growth.label, growth.growth_bytes, growth.since_step, growth.steps, growth.jump) == (
        "allocated_bytes", "PyTorch-allocated memory", 64 * MiB, 20, 21, True)
    late = {**steps, 30: 2 * GiB + 57 * MiB}  # 90 % of 64 MiB is 57.6 MiB: reached at step 31, 11 steps on
    assert term_growths(_grown({}, last=40, allocated=late), 0, _oom(41))[0].jump is False
    assert term_growths(_grown({}, last=40, allocated={31: 2 * GiB + 64 * MiB - 1}), 0, _oom(41)) == []
    # An unknown term at either end is not judged, the others are; no term grew, no growth.
    unknown = ListPoints([_point(0, non_torch=None), _point(5, non_torch=2 * GiB, allocated=None)])
    assert term_growths(unknown, 0, _oom(6)) == [] and term_growth(unknown, 0, _oom(6)) is None
    slack = ListPoints([_point(0, non_torch=None), _point(5, non_torch=2 * GiB, slack=GiB)])
    assert [g.term for g in term_growths(slack, 0, _oom(6))] == ["cache_slack_bytes"]


def test_two_terms_growing_alike_keep_the_ledgers_order() -> None:
    points = _grown({30: GiB + 100 * MiB}, last=40, allocated={30: 2 * GiB + 100 * MiB})
    assert [g.term for g in term_growths(points, 0, _oom(41))] == ["non_torch_bytes", "allocated_bytes"]


def _leak_growth(points: ListPoints, oom: Event) -> TermGrowth:
    [growth] = term_growths(points, 0, oom)
    assert growth.term == "non_torch_bytes"
    return growth


def test_another_processs_jump_is_told_from_a_leak_already_under_way() -> None:
    # 4 MiB a step from step 10; another process's 1 GiB lands over steps 51 and 52 (400 MiB, then all of it): the
    # jump shows at step 52, the first with half of it.
    other = {51: 400 * MiB, 52: GiB}
    points = _grown({step: GiB + (step - 10) * 4 * MiB + next((other[s] for s in (52, 51) if s <= step), 0)
                     for step in range(10, 80)})
    oom = _oom(80)
    growth = _leak_growth(points, oom)
    assert (growth.from_bytes, growth.growth_bytes, growth.since_step) == (GiB, 276 * MiB + GiB, 10)
    # The flag measured the rise from step 50 to 52: 1 GiB and the leak's 8 MiB. The leak's 4 MiB a step before the
    # jump (160 MiB over the 40 steps from its onset) is taken out of it.
    split = split_outside(growth, points, oom, GiB + 8 * MiB, 50, 52)
    assert split == OutsideSplit(GiB, 52, TermGrowth("non_torch_bytes", NON_TORCH, GiB, 2 * GiB + 276 * MiB,
                                                     276 * MiB, 10, 70, 70.0, jump=False))
    # The jump is at most the whole growth, and never below nothing.
    assert split_outside(growth, points, oom, 3 * GiB, 50, 52) is None
    negative = split_outside(growth, points, oom, 0, 50, 52)
    assert (negative.jump_bytes, negative.jump_step, negative.leak.growth_bytes) == (0, 50, growth.growth_bytes)


def test_a_leak_that_began_after_the_jump_is_timed_from_where_the_jump_settled() -> None:
    # 1 GiB from another process at step 51, level until step 60, then 4 MiB a step (76 MiB by step 79).
    points = _grown({51: 2 * GiB, 60: 2 * GiB + 512 * 1024, **{s: 2 * GiB + (s - 60) * 4 * MiB for s in range(61, 80)}})
    oom = _oom(80)
    growth = _leak_growth(points, oom)
    assert (growth.since_step, growth.growth_bytes) == (50, GiB + 76 * MiB)
    assert split_outside(growth, points, oom, GiB, 50, 51) == OutsideSplit(
        GiB, 51, TermGrowth("non_torch_bytes", NON_TORCH, 2 * GiB + 512 * 1024, 2 * GiB + 76 * MiB,
                            76 * MiB, 60, 20, 20.0, jump=False))
    # Only the jump grew (a leak under 64 MiB beside it), or nothing is known where the flag settled.
    assert split_outside(growth, points, oom, GiB + 12 * MiB + 1, 50, 51) is None
    assert split_outside(growth, points, oom, GiB + 12 * MiB, 50, 51).leak.growth_bytes == 64 * MiB
    assert split_outside(growth, points, oom, GiB, 50, 90) is None


def test_a_slow_start_or_a_short_one_times_the_leak_from_the_jump() -> None:
    # Level at 1 GiB to step 40; 1 MiB over it by step 50 (within the tolerance), then 1 GiB at step 51 and 4 MiB a
    # step from step 60: what crept before the jump is not a leak of its own.
    points = _grown({41: GiB + MiB, 51: 2 * GiB, **{s: 2 * GiB + (s - 60) * 4 * MiB for s in range(61, 80)}})
    oom = _oom(80)
    growth = _leak_growth(points, oom)
    assert split_outside(growth, points, oom, GiB - MiB, 50, 51).leak.since_step == 60
    # Ten steps of a leak before the jump are too short to time it by.
    short = _grown({**{s: GiB + (s - 40) * 2 * MiB for s in range(41, 51)}, 51: 2 * GiB + 20 * MiB,
                    **{s: 2 * GiB + 20 * MiB + (s - 60) * 4 * MiB for s in range(61, 80)}})
    growth = _leak_growth(short, oom)
    assert growth.since_step == 40 and split_outside(growth, short, oom, GiB + 2 * MiB, 50, 51).leak.since_step == 60
    eleven = _grown({**{s: GiB + (s - 39) * 2 * MiB for s in range(40, 51)}, 51: 2 * GiB + 22 * MiB,
                     **{s: 2 * GiB + 22 * MiB + (s - 60) * 4 * MiB for s in range(61, 80)}})
    growth = _leak_growth(eleven, oom)
    assert split_outside(growth, eleven, oom, GiB + 2 * MiB, 50, 51).leak.since_step == growth.since_step == 39


def test_a_leak_one_step_old_at_the_jump_is_taken_out_of_it() -> None:
    # Level to step 49, 4 MiB a step from step 50, and 1 GiB more at step 51: the flag's rise from 50 to 51 holds
    # one leaked step.
    points = _grown({s: GiB + (s - 49) * 4 * MiB + (GiB if s >= 51 else 0) for s in range(50, 80)})
    oom = _oom(80)
    growth = _leak_growth(points, oom)
    split = split_outside(growth, points, oom, GiB + 4 * MiB, 50, 51)
    assert (growth.since_step, split.jump_bytes, split.jump_step, split.leak.since_step) == (49, GiB, 51, 51)


def test_a_creep_of_no_more_than_the_tolerance_before_the_jump_is_not_a_leak() -> None:
    # 1 MiB over the level at step 30 (the growth's onset), 2 MiB over it from step 31 to 50: 1 MiB crept over 20
    # steps, no more than the tolerance. The leak is timed from the end of the level after the jump (step 60).
    points = _grown({30: GiB + MiB, 31: GiB + 2 * MiB, 51: 2 * GiB + 2 * MiB,
                     **{s: 2 * GiB + 2 * MiB + (s - 60) * 4 * MiB for s in range(61, 80)}})
    oom = _oom(80)
    growth = _leak_growth(points, oom)
    assert (growth.since_step, growth.from_bytes) == (30, GiB + MiB)
    assert split_outside(growth, points, oom, GiB, 50, 51).leak.since_step == 60


def test_a_jump_the_points_never_reach_again_is_placed_at_the_flags_first_step() -> None:
    # 8 MiB a step from step 10 to 50, then 1 MiB a step: most of the growth was before the flag, whose 200 MiB rise
    # (192 MiB once the leak's 8 MiB a step is taken out) the points never show half of.
    points = _grown({s: GiB + (s - 10) * 8 * MiB if s <= 50 else GiB + 320 * MiB + (s - 50) * MiB
                     for s in range(10, 80)})
    oom = _oom(80)
    growth = _leak_growth(points, oom)
    split = split_outside(growth, points, oom, 200 * MiB, 50, 51)
    assert (growth.growth_bytes, split.jump_bytes, split.jump_step, split.leak.growth_bytes) == (
        349 * MiB, 192 * MiB, 50, 157 * MiB)


def test_only_non_pytorch_growth_with_a_point_at_the_flag_is_split() -> None:
    points = _grown({51: 2 * GiB, **{s: 2 * GiB + (s - 60) * 4 * MiB for s in range(61, 80)}})
    oom = _oom(80)
    growth = _leak_growth(points, oom)
    assert split_outside(TermGrowth("allocated_bytes", "a", GiB, 2 * GiB, GiB, 50, 30, 30.0, False), points, oom,
                         GiB, 50, 51) is None
    assert split_outside(growth, points, oom, GiB, 90, 91) is None
    unknown = ListPoints([*points.points[:50], _point(50, non_torch=None), *points.points[51:]])
    assert split_outside(growth, unknown, oom, GiB, 50, 51) is None
    unsettled = ListPoints([*points.points[:51], _point(51, non_torch=None), *points.points[52:]])
    assert split_outside(growth, unsettled, oom, GiB, 50, 51) is None


def test_the_last_window_reaches_a_hundred_steps_back_and_ends_at_no_margin_where_memory_ran_out() -> None:
    points = ListPoints([_point(step, non_torch=GiB + step * MiB, slack=None if step == 150 else 100 * MiB,
                                free=10 * GiB - step * MiB, margin=3 * GiB - step * MiB) for step in range(151)])
    window = last_window(points, _oom(151))
    start = {"driver_free_bytes": 10 * GiB - 51 * MiB, "non_torch_bytes": GiB + 51 * MiB,
             "cache_slack_bytes": 100 * MiB, "allocated_bytes": 2 * GiB, "oom_margin_bytes": 3 * GiB - 51 * MiB}
    end = {"driver_free_bytes": 10 * GiB - 150 * MiB, "non_torch_bytes": GiB + 150 * MiB, "cache_slack_bytes": None,
           "allocated_bytes": 2 * GiB, "oom_margin_bytes": 0}
    assert window == WindowChange(51, 150, 99.0, start, end)
    assert last_window(points, _oom(151), ran_out=False).end["oom_margin_bytes"] == 3 * GiB - 150 * MiB
    assert window_sentence(window) == (
        "From step 51 to step 150 (99 s), free memory went from 10.0 GiB to 9.9 GiB; non-PyTorch +99.0 MiB, cache "
        "slack -, allocated +0 B.")
    # One step has no change to tell, nor has a rank without points.
    assert last_window(ListPoints(points.points[-1:]), _oom(151)) is None
    assert last_window(ListPoints([]), _oom(151)) is None
    # Points that end over a hundred steps before the out-of-memory have no window.
    assert last_window(ListPoints(points.points[:10]), _oom(151)) is None


def test_a_window_says_each_change_with_its_sign() -> None:
    window = WindowChange(1_000, 1_100, 150.0,
                          {"driver_free_bytes": 3 * GiB, "non_torch_bytes": GiB, "cache_slack_bytes": 300 * MiB,
                           "allocated_bytes": None},
                          {"driver_free_bytes": 0, "non_torch_bytes": GiB - 5 * MiB, "cache_slack_bytes": 300 * MiB,
                           "allocated_bytes": GiB})
    assert window_sentence(window) == (
        "From step 1,000 to step 1,100 (2.5 min), free memory went from 3.0 GiB to 0 B; non-PyTorch -5.0 MiB, cache "
        "slack +0 B, allocated -.")
    assert window_sentence(WindowChange(1, 2, 2.5, window.start, window.end)).startswith(
        "From step 1 to step 2 (2 s), ")  # to the second, half to even
    assert (capital("rank 0 ran out"), capital("")) == ("Rank 0 ran out", "")


def test_a_stored_leak_is_searched_through_the_store(runtime_dir: Path, db_path: Path) -> None:
    # non_torch_leak: 2.5 MiB a step outside PyTorch from step 200 until the device is full (a crash).
    run_id = store_scenario("non_torch_leak", runtime_dir, db_path)
    (end,) = explain_run(open_store(db_path, readonly=True), run_id).ooms
    growth, window = end.growth, end.window
    assert (growth.term, growth.since_step, growth.growth_bytes, growth.jump) == (
        "non_torch_bytes", 199, (end.step - 199) * 2_621_440, False)
    assert (window.from_step, window.to_step, window.end["oom_margin_bytes"]) == (end.step - 100, end.step, 0)
    assert window.end["non_torch_bytes"] - window.start["non_torch_bytes"] == 100 * 2_621_440
