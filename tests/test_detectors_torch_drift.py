"""torch_drift: PyTorch memory kept across steps that keeps rising, told from growth that levels off.

Streams come from ``SyntheticRun`` with jitter off where numbers are checked: serving sample ``i`` is
step ``6 + i``; what stays allocated beyond weights and KV is the 200 MiB of graph buffers plus what
the fault keeps. The OOM margin there is ``MARGIN`` (see test_detectors_oom) less what is kept.
"""

from __future__ import annotations

from test_detectors_oom import MARGIN

from memwatch.flags import ACTIVATION_OVER_RESERVE, CRITICAL, OOM_RISK, TORCH_DRIFT, WARNING, severity_at_least

from synthetic import GiB, MiB, SyntheticRun, kinds, run_flags

GRAPHS = 200 * MiB


def test_steady_keep_alive_is_torch_drift_with_its_rate_and_steps_left() -> None:
    flags = run_flags(SyntheticRun(jitter=False, kept_from=100, kept_per_step=2 * MiB, serve_steps=700))
    drift = [flag for flag in flags if flag.kind == TORCH_DRIFT]
    assert len(drift) == 1
    flag = drift[0]
    # kept(i) = 2 MiB x (i - 99). Blocks of 50 samples from i = 0; the floor of block b is kept(50 b), so
    # floors in units of 2 MiB are 0, 0, 1, 51, 101, 151, 201. Judged when a block completes, five floors
    # must each rise by an eighth of their whole rise: blocks 2..6 (1, 51, ..., 201) at i = 349, the first.
    assert flag.step == 6 + 349
    growth = 2 * MiB * (349 - 99)
    assert flag.data["growth_bytes"] == growth
    assert (flag.data["baseline_step"], flag.data["baseline_torch_kept_bytes"]) == (6, GRAPHS)
    # The rate: floors of blocks 2..6 rose by 200 x 2 MiB over the window's 200 steps
    assert (flag.data["slope_bytes_per_step"], flag.data["steps"]) == (2 * MiB, 200)
    margin = MARGIN - growth
    assert flag.data["oom_margin_bytes"] == margin
    assert flag.data["steps_left"] == margin // (2 * MiB)
    # (MARGIN - 500 MiB) / 2 MiB = 3,385 steps left: beyond the 2,000-step horizon, so a warning
    assert flag.severity == WARNING
    assert flag.message == ("PyTorch memory that outlives each step grew by 500.0 MiB over its level "
                            "when serving began (step 6), at 2.0 MiB/step "
                            "over the last 200 steps; at this rate the device is full in about "
                            f"{margin // (2 * MiB):,} steps: look for tensors kept across steps (outputs, logprobs "
                            "or metadata held per request)")


def test_a_keep_alive_that_will_end_the_run_is_critical_and_named_by_oom_risk() -> None:
    flags = run_flags(SyntheticRun(jitter=False, kept_from=100, kept_per_step=8 * MiB, serve_steps=400))
    drift = next(flag for flag in flags if flag.kind == TORCH_DRIFT)
    # MARGIN / 8 MiB = 908 steps of room: within the horizon, the leak will end the run
    assert drift.severity == CRITICAL and drift.data["steps_left"] <= 908
    risk = next(flag for flag in flags if flag.kind == OOM_RISK)
    assert risk.data["cause"] == "torch_kept_bytes"
    assert risk.data["slope_bytes_per_step"] == 8 * MiB
    assert ACTIVATION_OVER_RESERVE not in {flag.kind for flag in flags}


def test_noisy_keep_alive_is_still_drift() -> None:
    flags = run_flags(SyntheticRun(kept_from=100, kept_per_step=2 * MiB, serve_steps=700))
    drift = [flag for flag in flags if flag.kind == TORCH_DRIFT]
    assert len(drift) == 1
    # block floors are within the 32 MiB of allocation noise, spread over the window's 200 steps
    assert abs(drift[0].data["slope_bytes_per_step"] - 2 * MiB) <= 32 * MiB // 200 + 1


def test_a_leak_that_stops_is_named_once() -> None:
    run = SyntheticRun(jitter=False, kept_from=100, kept_per_step=2 * MiB, kept_until=600, serve_steps=2_000)
    assert [flag.kind for flag in run_flags(run)].count(TORCH_DRIFT) == 1


def test_growth_over_a_few_dozen_steps_that_levels_off_is_not_drift() -> None:
    # Graphs captured for 40 new batch sizes, 8 MiB each (320 MiB), then level: no window of 200 samples rises
    # through all four of its quarters.
    run = SyntheticRun(jitter=False, kept_from=100, kept_per_step=8 * MiB, kept_until=140, serve_steps=1_000)
    assert TORCH_DRIFT not in {flag.kind for flag in run_flags(run)}


def test_one_time_growth_that_levels_off_is_not_drift() -> None:
    # A 2 GiB buffer allocated once (a lazily allocated cache), then graphs captured for new batch sizes
    # at a few later steps: large, but levelled off in every window.
    once = ((50, 2 * GiB), (120, 64 * MiB), (180, 64 * MiB), (260, 64 * MiB), (400, 64 * MiB))
    flags = run_flags(SyntheticRun(kept_once=once, serve_steps=1_500))
    assert [flag for flag in flags if severity_at_least(flag.severity, WARNING)
            and flag.kind != OOM_RISK] == []
    assert TORCH_DRIFT not in {flag.kind for flag in flags}


def test_kv_usage_and_a_clean_run_raise_nothing() -> None:
    # KV blocks cycle between 40 and 85 % inside the preallocated cache: allocated does not move.
    assert kinds(run_flags(SyntheticRun(serve_steps=2_000))) == []
