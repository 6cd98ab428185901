"""fragmentation, activation_over_reserve, reserve_overstated and kv_pressure on their fault patterns.

Streams come from ``SyntheticRun`` with jitter off: serving sample ``i`` is step ``6 + i``; prefill
(every 8th step, from ``i = 0``) peaks at 0.9 of the real reserve, decode at 0.05; CUDA graphs leave
200 MiB allocated in a 300 MiB pool; the KV cache is 3,610 blocks of 14,680,064 bytes.
"""

from __future__ import annotations

from memwatch.detectors import DetectorConfig
from memwatch.flags import (
    ACTIVATION_OVER_RESERVE,
    CRITICAL,
    FRAGMENTATION,
    INFO,
    KV_PRESSURE,
    OOM_RISK,
    RESERVE_OVERSTATED,
    WARNING,
)

from synthetic import BLOCK_BYTES, GB, MiB, SyntheticRun, kinds, run_flags

RESERVE = 4 * GB
GRAPH_ALLOCATED = 200 * MiB


def test_fragmentation_once_when_pinned_cache_grows_past_the_threshold() -> None:
    flags = run_flags(SyntheticRun(jitter=False, fragment_from=200, fragment_per_step=16 * MiB, serve_steps=900))
    # Pinned fragments also eat the driver's free memory: oom_risk warns first (the same trend shape as
    # the leak in test_detectors_oom, 100 steps later), then critical once under 256 MiB.
    assert kinds(flags) == [(OOM_RISK, WARNING), (FRAGMENTATION, WARNING), (OOM_RISK, CRITICAL)]
    flag = flags[1]
    # Threshold: max(256 MiB, 2 % of the 72 GB budget = 1.44 GB, half the 4 GB reserve) = 2 GB.
    # pinned(i) = 100 MiB of graph pool + 16 MiB x (i - 199); 16 MiB x k >= 2 GB from k = 120,
    # the 20th such sample in a row is k = 139 (i = 338) -> step 344.
    assert flag.step == 6 + 338
    assert flag.data["threshold_bytes"] == 2 * GB
    assert flag.data["baseline_pinned_cache_bytes"] == 100 * MiB
    assert flag.data["pinned_cache_bytes"] == 100 * MiB + 16 * MiB * 139
    assert flag.data["excess_bytes"] == 16 * MiB * 139
    assert flag.data["reclaimable_cache_bytes"] == int(0.9 * RESERVE)  # the last prefill's segments
    assert flag.data["sustained_steps"] == 20
    assert flag.message.startswith("2.3 GiB of the allocator's cache is pinned in partly used segments "
                                   "(the allocator holds 400 segments), 2.2 GiB more than when serving started")


def test_pinned_growth_just_under_the_threshold_is_not_fragmentation() -> None:
    # The last sample (i = 318, k = 119) has 16 MiB x 119 = 1,996,488,704 bytes of growth: under 2 GB.
    flags = run_flags(SyntheticRun(jitter=False, fragment_from=200, fragment_per_step=16 * MiB, serve_steps=319))
    assert 16 * MiB * 119 == 1_996_488_704 < 2 * GB
    assert FRAGMENTATION not in {flag.kind for flag in flags}


def test_samples_without_allocator_signals_are_not_judged_for_fragmentation() -> None:
    run = SyntheticRun(jitter=False, fragment_from=200, fragment_per_step=16 * MiB, serve_steps=900,
                       allocator_signals=False)
    assert FRAGMENTATION not in {flag.kind for flag in run_flags(run)}


def test_step_over_the_reserve_once_per_episode() -> None:
    flags = run_flags(SyntheticRun(jitter=False, over_reserve_at=(16, 24), serve_steps=300))
    assert kinds(flags) == [(ACTIVATION_OVER_RESERVE, WARNING)]
    flag = flags[0]
    assert flag.step == 6 + 16
    # step activation = step peak above long-lived (6 GB + 200 MiB of graph buffers) - 200 MiB settled at start
    assert flag.data == {
        "step_activation_bytes": 6 * GB, "step_activation_peak_bytes": 6 * GB + GRAPH_ALLOCATED,
        "settled_activation_bytes": GRAPH_ALLOCATED, "activation_reserve_bytes": RESERVE, "over_bytes": 2 * GB,
        "step_kind": "prefill", "num_tokens": 8_192, "num_seqs": 64,
    }
    assert flag.message == ("a prefill step's activation peak of 5.6 GiB exceeded the warmup reserve of 3.7 GiB "
                            "by 1.9 GiB: warmup ran a smaller batch than serving (too short, or as decode)")


def test_step_over_the_reserve_rearms_after_enough_clear_steps() -> None:
    # 175 clear step peaks between i = 24 and i = 200 re-arm it (100 needed); 7 between 16 and 24 do not.
    flags = run_flags(SyntheticRun(jitter=False, over_reserve_at=(16, 24, 200), serve_steps=300))
    assert [(flag.kind, flag.step) for flag in flags] == [(ACTIVATION_OVER_RESERVE, 22),
                                                          (ACTIVATION_OVER_RESERVE, 206)]


def test_overstated_reserve_reports_regainable_bytes_and_blocks() -> None:
    # Warmup kept a 12 GB load-time peak; serving never needs more than 0.9 x 4 GB.
    run = SyntheticRun(jitter=False, reserve=12 * GB, true_reserve=4 * GB, serve_steps=600)
    flags = run_flags(run)
    assert kinds(flags) == [(RESERVE_OVERSTATED, INFO)]
    flag = flags[0]
    assert flag.step == 6 + 499  # judged on the 500th serving step with a peak
    regainable = 12 * GB - 3_600_000_000
    assert flag.data == {
        "activation_reserve_bytes": 12 * GB, "largest_step_activation_bytes": 3_600_000_000,
        "regainable_bytes": regainable, "regainable_blocks": regainable // BLOCK_BYTES,
        "block_bytes": BLOCK_BYTES, "settled_activation_bytes": GRAPH_ALLOCATED, "steps": 500,
    }
    assert regainable // BLOCK_BYTES == 572  # 8.4 GB / 14,680,064
    assert "7.8 GiB (572 KV blocks) of KV capacity is unused" in flag.message


def test_reserve_is_not_judged_without_per_step_peaks() -> None:
    run = SyntheticRun(jitter=False, reserve=12 * GB, true_reserve=4 * GB, step_peaks=False, serve_steps=600)
    assert run_flags(run) == []


def test_full_kv_cache_with_preemptions_is_pressure_once() -> None:
    flags = run_flags(SyntheticRun(jitter=False, kv_full_from=400, preempt_every=10, serve_steps=600))
    assert kinds(flags) == [(KV_PRESSURE, WARNING)]
    flag = flags[0]
    assert flag.step == 6 + 400  # the first full sample, right after the first preemption event
    assert flag.data == {
        "kv_blocks_used": 3_600, "kv_blocks_total": 3_610, "kv_used_bytes": 3_600 * BLOCK_BYTES,
        "kv_total_bytes": 3_610 * BLOCK_BYTES, "preemptions_in_window": 2, "window_steps": 100,
        "preemptions_total": 2,
    }
    assert flag.message.startswith("KV cache 99.7% full (3,600 of 3,610 blocks) with 2 preemptions in the last "
                                   "100 steps")


def test_full_kv_cache_without_preemptions_is_fine() -> None:
    assert run_flags(SyntheticRun(jitter=False, kv_full_from=100, serve_steps=400)) == []


def test_kv_pressure_ignores_preemptions_older_than_the_window() -> None:
    # Preemptions stop with the full cache at i = 450; a later full cache alone is not pressure.
    run = SyntheticRun(jitter=False, kv_full_from=400, kv_full_until=450, preempt_every=10, serve_steps=600)
    assert [(flag.kind, flag.step) for flag in run_flags(run)] == [(KV_PRESSURE, 406)]


def test_thresholds_are_configurable() -> None:
    config = DetectorConfig(fragmentation_min_bytes=256 * MiB, fragmentation_budget_fraction=0.001,
                            fragmentation_reserve_ratio=0.01, fragmentation_sustain_steps=5)
    run = SyntheticRun(jitter=False, fragment_from=200, fragment_per_step=16 * MiB, serve_steps=700)
    flags = [flag for flag in run_flags(run, config=config) if flag.kind == FRAGMENTATION]
    # max(256 MiB, 72 MB, 40 MB) = 256 MiB; 16 MiB x k >= 256 MiB from k = 16 (i = 215); the 5th is i = 219
    assert [flag.step for flag in flags] == [6 + 219]
    assert flags[0].data["excess_bytes"] == 16 * MiB * 20
