"""non_torch_drift and external_process: a slope and a step of memory outside PyTorch, told apart.

Streams come from ``SyntheticRun`` with jitter off, so every number follows from its knobs: serving
sample ``i`` is step ``6 + i``, and non-torch memory there is 1 GB + 64 MiB plus the fault.
"""

from __future__ import annotations

from memwatch.flags import EXTERNAL_PROCESS, NON_TORCH_DRIFT, WARNING

from synthetic import GiB, MiB, SyntheticRun, kinds, run_flags

BASELINE_NON_TORCH = 10**9 + 64 * MiB


def test_steady_leak_is_drift_with_its_slope_once() -> None:
    flags = run_flags(SyntheticRun(jitter=False, leak_from=100, leak_per_step=2 * MiB, serve_steps=600))
    assert kinds(flags) == [(NON_TORCH_DRIFT, WARNING)]
    flag = flags[0]
    # growth(i) = 2 MiB x (i - 99); first >= 256 MiB at i = 99 + 128 = 227 -> step 233
    assert flag.step == 233
    # growth began after the last sample at <= 64 MiB (a quarter of the threshold): i = 99 + 32 = 131, step 137
    assert flag.data == {
        "growth_bytes": 256 * MiB, "grown_bytes": 256 * MiB - 64 * MiB, "steps": 233 - 137,
        "slope_bytes_per_step": 2 * MiB, "onset_step": 137, "baseline_non_torch_bytes": BASELINE_NON_TORCH,
        "non_torch_bytes": BASELINE_NON_TORCH + 256 * MiB, "step_change_bytes": 0,
    }
    assert flag.message == ("non-PyTorch memory grew by 256.0 MiB while serving, 2.0 MiB/step over the last "
                            "96 steps")


def test_noisy_leak_is_still_drift() -> None:
    flags = run_flags(SyntheticRun(leak_from=100, leak_per_step=2 * MiB, serve_steps=600))
    assert kinds(flags) == [(NON_TORCH_DRIFT, WARNING)]
    # +-4 MiB of driver noise on each end of the growth moves the crossing by at most 4 steps around 233
    assert 229 <= flags[0].step <= 237
    assert 2 * MiB - 256 * 1024 <= flags[0].data["slope_bytes_per_step"] <= 2 * MiB + 256 * 1024


def test_steep_leak_is_drift_not_another_process() -> None:
    flags = run_flags(SyntheticRun(jitter=False, leak_from=100, leak_per_step=100 * MiB, serve_steps=130))
    assert kinds(flags) == [(NON_TORCH_DRIFT, WARNING)]
    # The rise never levels off, so no step change is confirmed; the slope is measured from i = 99.
    assert flags[0].data["slope_bytes_per_step"] == 100 * MiB
    assert flags[0].data["onset_step"] == 6 + 99


def test_step_change_is_another_process_not_drift() -> None:
    flags = run_flags(SyntheticRun(jitter=False, external_at=300, external_bytes=2 * GiB, serve_steps=600))
    assert kinds(flags) == [(EXTERNAL_PROCESS, WARNING)]
    flag = flags[0]
    # Seen at i = 300 against the window start i = 296 (step 302); confirmed after 8 level samples: i = 308
    assert flag.step == 6 + 308
    assert flag.data == {
        "jump_bytes": 2 * GiB, "from_step": 302, "non_torch_bytes": BASELINE_NON_TORCH + 2 * GiB,
        "baseline_non_torch_bytes": BASELINE_NON_TORCH, "driver_used_bytes": flag.data["driver_used_bytes"],
    }
    assert flag.message == ("memory outside this process's allocator jumped by 2.0 GiB within 4 steps and "
                            "stayed there: another process is likely using this GPU")


def test_process_that_leaves_again_raises_nothing_more() -> None:
    run = SyntheticRun(jitter=False, external_at=300, external_until=500, external_bytes=2 * GiB, serve_steps=900)
    assert kinds(run_flags(run)) == [(EXTERNAL_PROCESS, WARNING)]


def test_leak_on_top_of_another_process_counts_only_the_slope() -> None:
    run = SyntheticRun(jitter=False, external_at=50, external_bytes=1 * GiB, leak_from=200,
                       leak_per_step=2 * MiB, serve_steps=500)
    flags = run_flags(run)
    assert kinds(flags) == [(EXTERNAL_PROCESS, WARNING), (NON_TORCH_DRIFT, WARNING)]
    drift = flags[1]
    # The 1 GiB step is excluded: growth(i) = 2 MiB x (i - 199) reaches 256 MiB at i = 327
    assert drift.step == 6 + 327
    assert drift.data["growth_bytes"] == 256 * MiB
    assert drift.data["step_change_bytes"] == 1 * GiB


def test_one_sample_spike_raises_nothing() -> None:
    assert run_flags(SyntheticRun(spike_at=300, spike_bytes=1 * GiB, serve_steps=600)) == []
