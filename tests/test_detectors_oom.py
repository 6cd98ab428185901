"""oom_risk fires early on a gradual leak and stays quiet on a step; oom reports the event.

With jitter off, the OOM margin while serving is constant until a fault: the driver's free memory
plus the whole free cached segments (the last prefill's 3.6 GB, which the allocator releases before
failing; the graph pool's free 100 MiB is pinned and does not count) minus the reserve (4 GB):
``free = 80 GB - (1 GB + 64 MiB) - (14 GB + 3,610 x 14,680,064 + 300 MiB + 3.6 GB) = 8,023,287,296``,
``margin = free + 3.6 GB - 4 GB = 7,623,287,296`` bytes.
"""

from __future__ import annotations

import pytest

from memwatch.flags import CRITICAL, EXTERNAL_PROCESS, NON_TORCH_DRIFT, OOM, OOM_RISK, WARNING

from synthetic import GiB, MiB, SyntheticRun, kinds, run_flags

MARGIN = 7_623_287_296


def first_negative_margin(leak_per_step: int, leak_from: int = 100) -> int:
    """Serving index where margin - leak x (i - leak_from + 1) first drops below zero."""
    return leak_from - 1 + MARGIN // leak_per_step + 1


@pytest.mark.parametrize("leak_per_step", [1 * MiB, 8 * MiB, 32 * MiB])
def test_gradual_leak_warns_at_least_50_steps_before_the_oom(leak_per_step: int) -> None:
    oom_at = first_negative_margin(leak_per_step)
    run = SyntheticRun(leak_from=100, leak_per_step=leak_per_step, oom_at=oom_at, serve_steps=oom_at + 1)
    flags = run_flags(run)
    risk = next(flag for flag in flags if flag.kind == OOM_RISK)
    oom = next(flag for flag in flags if flag.kind == OOM)
    assert risk.severity == WARNING
    assert oom.step == 6 + oom_at
    assert oom.step - risk.step >= 50
    assert 0 < risk.data["steps_to_zero"] <= 2_000


def test_gradual_leak_forecast_by_hand() -> None:
    oom_at = first_negative_margin(8 * MiB)
    assert oom_at == 1_008  # 99 + 7,623,287,296 // 8,388,608 + 1
    flags = run_flags(SyntheticRun(jitter=False, leak_from=100, leak_per_step=8 * MiB, oom_at=oom_at,
                                   serve_steps=2_000))
    assert kinds(flags) == [(OOM_RISK, WARNING), (NON_TORCH_DRIFT, WARNING), (OOM_RISK, CRITICAL), (OOM, CRITICAL)]
    warning, _drift, critical, oom = flags
    # Window of 40 samples: the fall over [i-40, i-20] must carry a quarter of the fall over [i-40, i]:
    # 8 MiB x (i - 119) >= 8 MiB x (i - 99) / 4 from i = 126; sustained 5 samples -> i = 130, step 136.
    assert warning.step == 136
    drop = 8 * MiB * (130 - 99)
    margin = MARGIN - drop
    assert warning.data["oom_margin_bytes"] == margin
    # The rate is fitted from the onset (i = 99, the last sample at the window's first margin), not over the
    # whole window, which would read it 31/40 of the leak: 8 MiB/step over 31 steps.
    assert warning.data["slope_bytes_per_step"] == 8 * MiB
    assert warning.data["steps_to_zero"] == margin // (8 * MiB) == 1_008 - 130 - 1
    assert warning.data["ns_to_zero"] == margin * 31 * 25_000_000 // drop
    assert warning.data["trend_steps"] == 31
    assert warning.message == ("the OOM margin of 6.9 GiB is falling by 8.0 MiB/step: the next worst-case forward "
                               "will not fit in about 877 steps (22 s)")
    # Critical once the margin is under 256 MiB: 8 MiB x (i - 99) > MARGIN - 256 MiB from i = 976.
    assert critical.step == 6 + 976
    assert critical.data["oom_margin_bytes"] == MARGIN - 8 * MiB * 877
    assert critical.data["threshold_bytes"] == 256 * MiB
    assert oom.step - warning.step == 6 + 1_008 - 136


def test_a_step_down_in_margin_is_not_a_trend() -> None:
    # 2 GiB taken at once leaves 5.7 GB of margin: an external process, not a countdown to OOM.
    flags = run_flags(SyntheticRun(jitter=False, external_at=300, external_bytes=2 * GiB, serve_steps=600))
    assert kinds(flags) == [(EXTERNAL_PROCESS, WARNING)]


def test_a_step_that_leaves_no_margin_is_critical() -> None:
    flags = run_flags(SyntheticRun(jitter=False, external_at=300, external_bytes=7_600 * MiB, serve_steps=500))
    assert kinds(flags) == [(OOM_RISK, CRITICAL), (EXTERNAL_PROCESS, WARNING)]
    critical = flags[0]
    assert critical.step == 6 + 300
    assert critical.data["oom_margin_bytes"] == MARGIN - 7_600 * MiB == -345_890_304
    assert critical.message == ("the next worst-case forward needs 329.9 MiB more than the GPU has left: "
                                "it will run out of memory")


def test_oom_event_is_a_critical_flag_with_the_event_and_last_margin() -> None:
    flags = run_flags(SyntheticRun(jitter=False, oom_at=50, serve_steps=100))
    assert kinds(flags) == [(OOM, CRITICAL)]
    flag = flags[0]
    assert flag.step == 6 + 50
    assert flag.data["requested_bytes"] == 2 * GiB
    assert flag.data["driver_free_bytes"] == 1 * GiB
    assert flag.data["oom_margin_bytes"] == MARGIN  # from the last sample before the event
    assert flag.message.startswith("out of memory: a request for 2.0 GiB failed with 1.0 GiB free on the device")
