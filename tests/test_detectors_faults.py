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

from synthetic import BLOCK_BYTES, GB, GiB, MiB, SyntheticRun, kinds, run_flags

RESERVE = 4 * GB
GRAPH_ALLOCATED = 200 * MiB


def test_fragmentation_once_with_the_excess_over_what_serving_needs() -> None:
    flags = run_flags(SyntheticRun(jitter=False, fragment_from=200, fragment_per_step=16 * MiB, serve_steps=900))
    # The cache also eats the driver's free memory, so oom_risk warns, then turns critical first.
    assert kinds(flags) == [(OOM_RISK, WARNING), (OOM_RISK, CRITICAL), (FRAGMENTATION, WARNING)]
    assert [f.step for f in flags] == [254, 668, 765]
    flag = flags[2]
    baseline = 100 * MiB + int(0.9 * RESERVE)  # graph pool - graph buffers + the first prefill's cache
    expected = baseline + 2 * RESERVE  # freed activations of a growing batch cache up to twice the reserve
    # fragments(i) = 16 MiB x (i - 199); excess = fragments - 2 x reserve >= 1 GiB from k = 541,
    # the 20th such sample in a row is k = 560 (i = 759) -> step 765
    fragments = 16 * MiB * 560
    assert flag.step == 765
    assert flag.data["cache_slack_bytes"] == baseline + fragments
    assert flag.data["excess_bytes"] == fragments - 2 * RESERVE == 1_395_240_960
    assert flag.data["expected_slack_bytes"] == expected
    assert flag.data["baseline_cache_slack_bytes"] == baseline
    assert flag.data["sustained_steps"] == 20
    assert flag.data["reserved_bytes"] - flag.data["allocated_bytes"] == baseline + fragments
    assert flag.message.startswith("the allocator caches 12.2 GiB that no tensor uses, 1.3 GiB more than serving")


def test_slack_just_under_the_threshold_is_not_fragmentation() -> None:
    # The last sample (i = 739, k = 540) has 16 MiB x 540 - 8 GB = 1,059,696,640 bytes of excess: under 1 GiB.
    flags = run_flags(SyntheticRun(jitter=False, fragment_from=200, fragment_per_step=16 * MiB, serve_steps=740))
    assert 16 * MiB * 540 - 2 * RESERVE == 1_059_696_640 < GiB
    assert FRAGMENTATION not in {flag.kind for flag in flags}


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
    config = DetectorConfig(fragmentation_min_bytes=256 * MiB, fragmentation_sustain_steps=5)
    run = SyntheticRun(jitter=False, fragment_from=200, fragment_per_step=16 * MiB, serve_steps=700)
    flags = [flag for flag in run_flags(run, config=config) if flag.kind == FRAGMENTATION]
    # 16 MiB x k - 8 GB >= 256 MiB from k = 493 (i = 692); the 5th such sample is i = 696 -> step 702
    assert [flag.step for flag in flags] == [702]
    assert flags[0].data["excess_bytes"] == 16 * MiB * 497 - 2 * RESERVE
