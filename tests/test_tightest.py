"""A healthy rank's tightest moment: the need read back from the margin, and a parenthesis that adds up to it.

Every number is chosen by hand: 1,000 MiB free, 200 MiB reclaimable, a 500 MiB activation reserve."""

from __future__ import annotations

from memwatch.detectors.summary import ServingPoint
from memwatch.report.tightest import forward_need, tightest_report

MIB = 1 << 20


def point(margin: int | None, *, reclaimable: int | None = 200 * MIB, slack: int | None = 250 * MIB,
          free: int | None = 1000 * MIB, step: int = 7, ts_ns: int = 70) -> ServingPoint:
    return ServingPoint(step=step, ts_ns=ts_ns, non_torch_bytes=512 * MIB, cache_slack_bytes=slack,
                        allocated_bytes=4000 * MIB, driver_free_bytes=free, oom_margin_bytes=margin,
                        activation_reserve_bytes=500 * MIB, headroom_bytes=30 * MIB,
                        reclaimable_cache_bytes=reclaimable)


def test_the_reserve_is_the_need() -> None:
    tight = point(700 * MIB)  # 1,000 + 200 − 500
    assert forward_need(tight) == 500 * MIB
    report = tightest_report(3, tight, point(900 * MIB, step=0, ts_ns=0))
    assert report is not None
    assert (report.rank, report.step, report.oom_margin_bytes, report.need_bytes, report.ts_ns) == (
        3, 7, 700 * MIB, 500 * MIB, 70)
    assert (report.driver_free_bytes, report.cache_slack_bytes, report.reclaimable_cache_bytes) == (
        1000 * MIB, 250 * MIB, 200 * MIB)
    assert (report.activation_reserve_bytes, report.headroom_bytes, report.at_serving_start) == (
        500 * MIB, 30 * MIB, False)
    assert report.sentence == (
        "rank 3's tightest serving moment was step 7: 700.0 MiB would have been left after a worst-case forward "
        "(1000.0 MiB free + 200.0 MiB reclaimable of the 250.0 MiB cache slack − the 500.0 MiB activation "
        "reserve).")


def test_a_step_rise_above_the_reserve_is_named_as_the_need() -> None:
    tight = point(600 * MIB)  # a step rose 600 MiB: 1,000 + 200 − 600
    assert forward_need(tight) == 600 * MIB
    report = tightest_report(0, tight, None)
    assert report is not None and report.need_bytes == 600 * MIB
    assert report.sentence.endswith(
        "(1000.0 MiB free + 200.0 MiB reclaimable of the 250.0 MiB cache slack − the 600.0 MiB largest step rise "
        "seen, above the 500.0 MiB activation reserve warmup measured).")


def test_the_first_serving_sample_as_the_tightest() -> None:
    tight = point(700 * MIB, step=0, ts_ns=5)
    report = tightest_report(1, tight, point(700 * MIB, step=0, ts_ns=5))
    assert report is not None and report.at_serving_start
    assert report.sentence.startswith("rank 1's OOM margin never fell below where it stood when serving began: ")
    # the same step at another moment is not the first sample
    later = tightest_report(1, tight, point(700 * MIB, step=0, ts_ns=4))
    assert later is not None and not later.at_serving_start


def test_without_allocator_signals_slack_counts_up_to_the_need() -> None:
    # slack 100 below the 500 need: margin = 1,000 − (500 − 100)
    tight = point(600 * MIB, reclaimable=None, slack=100 * MIB)
    assert forward_need(tight) == 500 * MIB
    report = tightest_report(0, tight, None)
    assert report is not None and report.sentence.endswith(
        "(1000.0 MiB free + 100.0 MiB cache slack − the 500.0 MiB activation reserve).")
    # slack 600 covers the need: the margin is the free memory, and the need cannot be read back from it
    covered = point(1000 * MIB, reclaimable=None, slack=600 * MIB)
    assert forward_need(covered) is None
    report = tightest_report(0, covered, None)
    assert report is not None and report.need_bytes is None and report.sentence.endswith(
        "(1000.0 MiB free; the 600.0 MiB cache slack holds the 500.0 MiB activation reserve).")


def test_what_cannot_be_said() -> None:
    assert tightest_report(0, None, None) is None
    assert tightest_report(0, point(None), None) is None
    assert forward_need(point(None)) is None
    assert forward_need(point(700 * MIB, free=None)) is None
    assert forward_need(point(700 * MIB, reclaimable=None, slack=None)) is None
