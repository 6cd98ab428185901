"""A realistic clean run raises nothing of warning or worse."""

from __future__ import annotations

from memwatch.detectors import replay
from memwatch.flags import WARNING, severity_at_least

from synthetic import GB, MiB, SyntheticRun, kinds, run_flags


def test_clean_run_raises_no_flag_at_all() -> None:
    assert run_flags(SyntheticRun(serve_steps=5_000)) == []


def test_clean_tensor_parallel_run_raises_nothing_of_warning_or_worse() -> None:
    # tp 2: per-rank weights, activations and KV heads halve; both ranks size the same count.
    ranks = [SyntheticRun(rank=rank, weights=7 * GB, reserve=2 * GB, seed=3) for rank in (0, 1)]
    flags = run_flags(*ranks)
    assert [flag for flag in flags if severity_at_least(flag.severity, WARNING)] == []


def test_clean_run_without_phases_or_step_peaks_is_silent() -> None:
    # A plain loop reports no phase and no per-step peak: serving starts at the first sample after sizing.
    assert run_flags(SyntheticRun(serve_phase=None, step_peaks=False, serve_steps=3_000)) == []


def test_light_workload_is_at_most_an_info_about_the_reserve() -> None:
    # Prefills far below warmup's worst case look like an overstated reserve: info, never a warning.
    flags = run_flags(SyntheticRun(prefill_fraction=(0.1, 0.3), serve_steps=1_000))
    assert kinds(flags) == [("reserve_overstated", "info")]


def test_replay_of_a_clean_run_reports_stable_terms_and_no_flags() -> None:
    run = SyntheticRun(serve_steps=500)
    result = replay(run.records())
    assert result.flags == []
    summary = result.ranks[0]
    assert summary.samples == 6 + 500
    assert summary.last_step == 6 + 499
    assert summary.sizing is not None and summary.sizing.num_blocks == run.num_blocks
    # The ledger's residual is minus the non-torch growth since sizing: 64 MiB of workspaces plus noise.
    last = summary.last_terms
    assert last is not None and last.residual_bytes is not None
    assert -64 * MiB - 4 * MiB <= last.residual_bytes <= -64 * MiB + 4 * MiB
