"""The run-level parts: block counts across ranks, the detector set's API, replay, config, vocabulary."""

from __future__ import annotations

import pytest

from memwatch.detectors import DetectorConfig, DetectorSet, interleave, replay
from memwatch.detectors.base import Episode
from memwatch.detectors.wording import format_bytes, format_count, format_duration_ns
from memwatch.errors import UsageError
from memwatch.flags import BLOCK_COUNT_MISMATCH, CRITICAL, FLAG_KINDS, INFO, WARNING, severity_at_least
from memwatch.records import Event, Sample

from synthetic import BLOCK_BYTES, GB, MiB, SyntheticRun, kinds, run_flags

FORMULA_BLOCKS = 3_610  # (72 - 1 - 14 - 4) GB // 14,680,064 on the synthetic run's readings


def test_ranks_with_different_block_counts() -> None:
    rank0 = SyntheticRun(jitter=False, serve_steps=10)
    rank1 = SyntheticRun(rank=1, jitter=False, num_blocks_override=FORMULA_BLOCKS - 5, serve_steps=10)
    flags = run_flags(rank0, rank1)
    assert kinds(flags) == [(BLOCK_COUNT_MISMATCH, WARNING), (BLOCK_COUNT_MISMATCH, WARNING)]
    own_rule, across = flags
    assert (own_rule.rank, own_rule.step) == (1, 4)
    assert own_rule.data == {"num_blocks": 3_605, "formula_blocks": FORMULA_BLOCKS, "difference_blocks": -5,
                             "difference_bytes": -5 * BLOCK_BYTES, "block_bytes": BLOCK_BYTES}
    assert own_rule.message == ("rank 1 sized 3,605 KV blocks but its own sizing rule gives 3,610 on its own "
                                "readings (-5 blocks, -70.0 MiB)")
    assert across.data == {"num_blocks_by_rank": {"0": 3_610, "1": 3_605}, "fewest_blocks": 3_605,
                           "most_blocks": 3_610, "spread_blocks": 5, "spread_bytes": 5 * BLOCK_BYTES,
                           "block_bytes": BLOCK_BYTES}
    assert across.message == ("the ranks of this run sized different KV block counts (rank 0: 3,610, rank 1: "
                              "3,605): only the smallest, 3,605, is safe to schedule on all of them")


def test_same_disagreement_is_reported_once() -> None:
    runs = [SyntheticRun(rank=rank, jitter=False, num_blocks_override=blocks, serve_steps=1)
            for rank, blocks in ((0, 3_610), (1, 3_610), (2, 3_600))]
    flags = run_flags(*runs)
    across = [flag for flag in flags if "num_blocks_by_rank" in flag.data]
    assert len(across) == 1
    assert across[0].data["num_blocks_by_rank"] == {"0": 3_610, "1": 3_610, "2": 3_600}


def test_one_flag_per_mismatch_whichever_rank_sizes_after_it() -> None:
    """Rank 1 of four sized fewer blocks: one disagreement, one flag, not one more each time a rank that agrees
    with rank 0 sizes after it (three flags, each naming a different set of ranks)."""
    runs = [SyntheticRun(rank=rank, jitter=False, num_blocks_override=blocks, serve_steps=1)
            for rank, blocks in ((0, 3_610), (1, 3_600), (2, 3_610), (3, 3_610))]
    across = [flag for flag in run_flags(*runs) if "num_blocks_by_rank" in flag.data]
    assert len(across) == 1
    assert across[0].data["fewest_blocks"] == 3_600 and across[0].data["most_blocks"] == 3_610


def test_a_count_not_seen_before_is_a_new_mismatch() -> None:
    runs = [SyntheticRun(rank=rank, jitter=False, num_blocks_override=blocks, serve_steps=1)
            for rank, blocks in ((0, 3_610), (1, 3_600), (2, 3_610), (3, 3_590))]
    across = [flag for flag in run_flags(*runs) if "num_blocks_by_rank" in flag.data]
    assert [flag.data["fewest_blocks"] for flag in across] == [3_600, 3_590]


def test_engine_count_off_its_own_rule() -> None:
    flags = run_flags(SyntheticRun(jitter=False, num_blocks_override=FORMULA_BLOCKS + 3, serve_steps=1))
    assert [(flag.kind, flag.data["difference_blocks"]) for flag in flags] == [(BLOCK_COUNT_MISMATCH, 3)]


def sizing_event(run_id: str = "run", rank: int = 0, **data: object) -> Event:
    return Event(run_id, rank, 4, 4, "kv_allocated", {
        "total_bytes": 16 << 30, "gpu_memory_utilization": 0.75, "used_bytes": 5 << 30, "peak_bytes": 7 << 30,
        "current_bytes": 4608 * MiB, "block_bytes": 100 * MiB, "num_blocks": 46, **data})


def test_one_detector_set_per_run() -> None:
    detectors = DetectorSet()
    detectors.on_event(sizing_event("run-a"))
    with pytest.raises(UsageError, match="records of run 'run-b' mixed into run 'run-a'"):
        detectors.on_sample(Sample("run-b", 0, 5, 5, "serve", 1, 1, 1, 1, 1))


def test_ledger_of_an_unseen_rank_is_a_usage_error() -> None:
    detectors = DetectorSet()
    detectors.on_event(sizing_event())
    assert detectors.ledger(0).sizing is not None
    assert detectors.ranks == (0,)
    with pytest.raises(UsageError, match=r"no records of rank 3 yet; ranks seen: \[0\]"):
        detectors.ledger(3)


def test_detectors_wait_for_serving() -> None:
    detectors = DetectorSet()
    detectors.on_event(sizing_event())
    long_lived = 4608 * MiB + 4600 * MiB
    # An activation peak of 6 GiB over a 2.5 GiB reserve during graph capture is not judged ...
    capture = Sample("run", 0, 5, 5, "cudagraph", long_lived, long_lived + (6 << 30), long_lived,
                     long_lived + 512 * MiB, (16 << 30) - long_lived - 512 * MiB, peak_is_step=True)
    assert detectors.on_sample(capture) == ()
    # ... the same while serving is.
    serving = capture._replace(step=6, phase="serve")
    assert [flag.kind for flag in detectors.on_sample(serving)] == ["activation_over_reserve"]


def test_replay_summarises_each_rank_and_its_tightest_moments() -> None:
    records = [*SyntheticRun(jitter=False, leak_from=100, leak_per_step=8 * MiB, serve_steps=300).records(),
               *SyntheticRun(rank=1, jitter=False, serve_steps=300).records()]
    result = replay(records)
    assert [flag.kind for flag in result.flags] == ["oom_risk", "non_torch_drift"]
    leaking, clean = result.ranks[0], result.ranks[1]
    assert (leaking.samples, leaking.last_step) == (306, 305)
    # The leak makes the last sample the tightest: margin = 7,623,287,296 - 8 MiB x (299 - 99)
    # (derived in test_detectors_oom)
    assert leaking.min_oom_margin is not None
    assert (leaking.min_oom_margin.step, leaking.min_oom_margin.value_bytes) == (305, 7_623_287_296 - 8 * MiB * 200)
    assert leaking.min_headroom is not None and leaking.min_headroom.step == 305
    # headroom = rounding remainder (4,968,960) - non-torch growth since sizing (64 MiB + 200 x 8 MiB)
    assert leaking.min_headroom.value_bytes == 4_968_960 - 64 * MiB - 8 * MiB * 200
    assert leaking.min_headroom.terms.residual_bytes == -64 * MiB - 8 * MiB * 200
    # The clean rank's tightest headroom comes when the 64 MiB of workspaces first appear (first serve step).
    assert clean.min_headroom is not None and clean.min_headroom.step == 6
    assert clean.sizing is not None and clean.sizing.num_blocks == FORMULA_BLOCKS


def test_interleave_orders_by_time_with_events_first() -> None:
    samples = [Sample("run", 0, step, step * 10, "serve", 0, 0, 0, 0, 0) for step in (1, 2, 3)]
    events = [Event("run", 0, 2, 20, "preemption", {"count": 1})]
    merged = list(interleave(samples, events))
    assert [(type(record).__name__, record.step) for record in merged] == [
        ("Sample", 1), ("Event", 2), ("Sample", 2), ("Sample", 3)]


def test_episode_fires_once_and_rearms_after_clear_samples() -> None:
    episode = Episode(rearm_steps=3)
    assert episode.fire() is True
    assert episode.fire() is False
    episode.settle(clear=True)
    episode.settle(clear=True)
    episode.settle(clear=False)  # in between: the count towards re-arming restarts
    episode.settle(clear=True)
    episode.settle(clear=True)
    assert episode.fire() is False
    for _ in range(3):
        episode.settle(clear=True)
    assert episode.active is False
    assert episode.fire() is True


def test_config_from_mapping_and_its_errors() -> None:
    assert DetectorConfig.from_mapping({"drift_min_bytes": 1 << 20}).drift_min_bytes == 1 << 20
    with pytest.raises(UsageError, match="unknown detector setting 'drift_bytes'; known settings: "):
        DetectorConfig.from_mapping({"drift_bytes": 1})
    with pytest.raises(UsageError, match="rearm_steps must be a positive integer, got 0"):
        DetectorConfig(rearm_steps=0)
    with pytest.raises(UsageError, match=r"kv_pressure_usage must be a fraction in \(0, 1\], got 1.5"):
        DetectorConfig(kv_pressure_usage=1.5)


def test_vocabulary_and_wording() -> None:
    assert FLAG_KINDS == ("non_torch_drift", "fragmentation", "activation_over_reserve", "reserve_overstated",
                          "external_process", "kv_pressure", "block_count_mismatch", "oom_risk", "oom",
                          "alloc_retries", "torch_drift")
    assert severity_at_least(CRITICAL, WARNING) and not severity_at_least(INFO, WARNING)
    assert format_bytes(3_328_599_654) == "3.1 GiB"  # 3,328,599,654 / 2^30 = 3.0999
    assert format_bytes(-2 * MiB) == "-2.0 MiB"
    assert format_count(1_200) == "1,200"
    assert [format_duration_ns(s * 10**9) for s in (41, 210, 7_200)] == ["41 s", "3.5 min", "2.0 h"]


def test_kv_pressure_is_judged_on_a_rank_without_sizing_where_the_scheduler_counts_blocks() -> None:
    """vLLM's scheduler rank counts KV blocks and preempts; the worker rank sized the cache. 16 of 16 blocks in use
    (≥ 0.95 of them) with one preemption within the window: the default config's kv_pressure, on the scheduler."""
    detectors = DetectorSet()
    detectors.on_event(sizing_event(rank=0))
    flags = []
    for step in range(1, 6):
        flags += detectors.on_sample(Sample("run", 1, step, step * 10, None, None, None, None, None, None,
                                            kv_blocks_used=16 if step >= 3 else 8, kv_blocks_total=16))
        if step == 2:
            flags += detectors.on_event(Event("run", 1, 2, 21, "preemption", {"count": 1}))
    assert [(flag.kind, flag.rank, flag.step) for flag in flags] == [("kv_pressure", 1, 3)]


def test_a_rank_without_sizing_and_free_blocks_raises_nothing() -> None:
    detectors = DetectorSet()
    flags = list(detectors.on_event(Event("run", 1, 1, 1, "preemption", {"count": 3})))
    for step in range(2, 50):
        flags += detectors.on_sample(Sample("run", 1, step, step, None, None, None, None, None, None,
                                            kv_blocks_used=10, kv_blocks_total=16))
    assert flags == []


def test_the_config_given_is_the_one_the_set_judges_with() -> None:
    config = DetectorConfig.from_mapping({"rearm_steps": 7})
    assert DetectorSet(config).config is config
    assert DetectorSet().config == DetectorConfig() and DetectorSet().config.rearm_steps == 100


def test_latest_terms_is_none_for_an_unseen_rank_and_before_a_ranks_first_sample() -> None:
    detectors = DetectorSet()
    assert detectors.latest_terms(3) is None
    detectors.on_event(sizing_event())
    assert detectors.latest_terms(0) is None and detectors.last_terms(0) is None
    detectors.on_sample(Sample("run", 0, 5, 5, "serve", 9 << 30, 9 << 30, 9 << 30, 10 << 30, 6 << 30))
    assert detectors.latest_terms(0) == detectors.last_terms(0) is not None
    assert detectors.latest_terms(1) is None


def test_an_oom_flag_carries_the_ranks_last_ledger_terms() -> None:
    detectors = DetectorSet()
    detectors.on_event(sizing_event())
    detectors.on_sample(Sample("run", 0, 5, 5, "serve", 9 << 30, 9 << 30, 9 << 30, 10 << 30, 6 << 30))
    terms = detectors.last_terms(0)
    assert terms is not None
    (flag,) = detectors.on_event(Event("run", 0, 6, 6, "oom", {"requested_bytes": 1 << 30}))
    assert flag.kind == "oom"
    assert flag.data == {"requested_bytes": 1 << 30, "oom_margin_bytes": terms.oom_margin_bytes,
                         "non_torch_bytes": terms.non_torch_bytes, "cache_slack_bytes": terms.cache_slack_bytes}
    # non-PyTorch: 10 GiB used - 9 GiB reserved = 1 GiB; slack: reserved - allocated = 0
    assert (terms.non_torch_bytes, terms.cache_slack_bytes) == (1 << 30, 0)


def test_ranks_of_different_data_parallel_engines_may_size_different_block_counts() -> None:
    """Ranks 0 and 1 size 46 and 45 blocks at the same moment: a mismatch within one engine, none across two."""
    def across(identities: bool) -> list[object]:
        detectors, flags = DetectorSet(), []
        for rank, blocks in ((0, 46), (1, 45)):
            if identities:
                detectors.on_event(Event("run", rank, 1, 1, "rank_identity", {"dp_rank": rank}))
            flags += detectors.on_event(sizing_event(rank=rank, num_blocks=blocks))
        return [flag.data["num_blocks_by_rank"] for flag in flags if "num_blocks_by_rank" in flag.data]

    assert across(identities=False) == [{"0": 46, "1": 45}]
    assert across(identities=True) == []


def test_a_sized_ranks_detectors_count_in_its_block_bytes() -> None:
    overstated = run_flags(SyntheticRun(jitter=False, reserve=12 * GB, true_reserve=4 * GB, serve_steps=600))
    assert [(flag.data["block_bytes"], flag.data["regainable_blocks"]) for flag in overstated] == [
        (BLOCK_BYTES, (12 * GB - 3_600_000_000) // BLOCK_BYTES)]
    full = run_flags(SyntheticRun(jitter=False, kv_full_from=400, preempt_every=10, serve_steps=600))
    assert [(flag.data["kv_used_bytes"], flag.data["kv_total_bytes"]) for flag in full] == [
        (3_600 * BLOCK_BYTES, 3_610 * BLOCK_BYTES)]


def test_a_rank_without_sizing_is_not_judged_during_startup_phases() -> None:
    """The same full cache and preemption that raise kv_pressure while serving raise nothing during warmup."""
    detectors = DetectorSet()
    flags = []
    for step in range(1, 6):
        flags += detectors.on_sample(Sample("run", 1, step, step * 10, "warmup", None, None, None, None, None,
                                            kv_blocks_used=16 if step >= 3 else 8, kv_blocks_total=16))
        if step == 2:
            flags += detectors.on_event(Event("run", 1, 2, 21, "preemption", {"count": 1}))
    assert flags == []
