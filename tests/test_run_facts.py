"""The shared quantities' rules, by hand: when a rank ran out, its margin at the end, which rank stands for a run."""

from __future__ import annotations

from memwatch.detectors.summary import RankSummary
from memwatch.flags import Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Event
from memwatch.store.run_figures import end_margin, ran_dry, truth_from, worst_rank

MIB = 1 << 20
GIB = 1 << 30


def test_ran_dry_under_two_percent_free() -> None:
    assert ran_dry(0, None) and ran_dry(0, 8 * GIB)
    # 2 % of 8 GiB is 171,798,691 B (integer division by 50): below it ran dry, at or above it did not
    assert ran_dry(171_798_690, 8 * GIB)
    assert not ran_dry(171_798_691, 8 * GIB)
    assert ran_dry(70 * MIB, 8 * GIB) and not ran_dry(1 * GIB, 8 * GIB)
    assert not ran_dry(None, 8 * GIB)
    assert not ran_dry(4 * MIB, None) and not ran_dry(4 * MIB, 0)  # a size unknown: only 0 B says it


def test_end_margin() -> None:
    assert end_margin(600, ran_out=False) == 600 and end_margin(None, ran_out=False) is None
    assert end_margin(600, ran_out=True) == 0
    assert end_margin(-5, ran_out=True) == -5
    assert end_margin(None, ran_out=True) == 0


def test_worst_rank() -> None:
    assert worst_rank([(0, None, -5), (1, 200, 0), (2, 100, 0)]) == 2
    assert worst_rank([(3, 100, 0), (1, 100, 0)]) == 1
    assert worst_rank([(0, None, 300), (1, None, None), (2, None, 100)]) == 2
    assert worst_rank([(2, None, 100), (1, None, 100)]) == 1
    assert worst_rank([(1, None, None), (0, None, None)]) == 0
    assert worst_rank([]) is None


def _terms(margin: int) -> LedgerTerms:
    return LedgerTerms(*([None] * len(LedgerTerms._fields)))._replace(oom_margin_bytes=margin)


def _sizing(rank: int) -> Event:
    return Event("run", rank, 0, 10, "kv_allocated", {
        "total_bytes": 8 * GIB, "gpu_memory_utilization": 0.5, "used_bytes": 2 * GIB, "reserved_bytes": 1536 * MIB,
        "peak_bytes": 1792 * MIB, "current_bytes": 1 * GIB, "block_bytes": 2 * MIB, "num_blocks": 100})


def test_truth_from_a_crash_that_left_one_rank_dry() -> None:
    """Two ranks; rank 1 crashed with 40 MiB of 8 GiB free (the ledger said +300 MiB), rank 0 with 3 GiB free."""
    events = [_sizing(0), _sizing(1), Event("run", 0, 0, 5, "weights_loaded", {"weights_bytes": 900 * MIB})]
    summaries = {0: RankSummary(0, last_terms=_terms(2 * GIB)), 1: RankSummary(1, last_terms=_terms(300 * MIB))}
    flags = [Flag("run", 1, 9, 20, "oom_risk", "warning", "m", {}), Flag("run", 1, 9, 21, "oom_risk", "critical", "m",
                                                                          {})]
    truth = truth_from("run", "crashed", events, summaries, flags, {0: 3 * GIB, 1: 40 * MIB}, {0: 8 * GIB, 1: 8 * GIB})
    zero, one = truth.ranks
    assert (zero.oom_margin_bytes, one.oom_margin_bytes) == (2 * GIB, 0)
    # used − reserved at sizing: 2 GiB − 1.5 GiB; the loaded weights where recorded, else current at sizing
    assert zero.non_torch_at_sizing_bytes == one.non_torch_at_sizing_bytes == 512 * MIB
    assert (zero.weights_bytes, one.weights_bytes) == (900 * MIB, 1 * GIB)
    assert zero.kv_cache_bytes == 100 * 2 * MIB
    assert truth.worst_rank == 1 and truth.oom_step is None
    assert truth.to_dict() == {"oom_step": None, "non_torch_at_sizing_bytes": 1 * GIB, "oom_margin_bytes": 0,
                               "weights_bytes": 900 * MIB + 1 * GIB, "kv_cache_bytes": 400 * MIB,
                               "flag_counts": {"oom_risk": 2}, "worst_rank": 1}
    # the same readings in a run that ended well: nobody ran out, each margin is the ledger's
    kept = truth_from("run", "ok", events, summaries, [], {0: 3 * GIB, 1: 40 * MIB}, {0: 8 * GIB, 1: 8 * GIB})
    assert [r.oom_margin_bytes for r in kept.ranks] == [2 * GIB, 300 * MIB]
    # without the device's size, only 0 B free says a crash ran dry
    unsized = truth_from("run", "crashed", events, summaries, [], {0: 3 * GIB, 1: 40 * MIB})
    assert [r.oom_margin_bytes for r in unsized.ranks] == [2 * GIB, 300 * MIB]


def test_truth_from_an_out_of_memory_on_one_rank() -> None:
    oom = Event("run", 1, 311, 50, "oom", {"requested_bytes": 8 * MIB, "driver_free_bytes": 0})
    later = Event("run", 0, 400, 60, "oom", {"requested_bytes": 8 * MIB, "driver_free_bytes": 0})
    summaries = {0: RankSummary(0, last_terms=_terms(-7)), 1: RankSummary(1, last_terms=_terms(5 * MIB))}
    truth = truth_from("run", "oom", [_sizing(0), _sizing(1), oom, later], summaries, [], {})
    assert [(r.rank, r.oom_step, r.oom_ts_ns, r.oom_margin_bytes) for r in truth.ranks] == [
        (0, 400, 60, -7), (1, 311, 50, 0)]
    # the first to run out stands for the run; the run's margin is its ranks' lowest
    assert truth.worst_rank == 1 and truth.oom_step == 311 and truth.oom_margin_bytes == -7
    assert truth.rank(1) is truth.ranks[1] and truth.rank(5) is None
    assert truth.ranks[1].to_dict() == {"rank": 1, "oom_step": 311, "non_torch_at_sizing_bytes": 512 * MIB,
                                        "oom_margin_bytes": 0, "weights_bytes": 1 * GIB,
                                        "kv_cache_bytes": 200 * MIB}


def test_what_a_rank_did_not_record() -> None:
    """A rank with samples but no sizing, one with only an out-of-memory, a weights event without a number."""
    from memwatch.store.run_figures import non_torch_from

    assert non_torch_from(2 * GIB, None, 1 * GIB) == 1 * GIB  # no reserved at sizing: used − current
    assert non_torch_from(2 * GIB, 1536 * MIB, 1 * GIB) == 512 * MIB
    assert non_torch_from(None, 1536 * MIB, 1 * GIB) is None and non_torch_from(2 * GIB, None, None) is None
    events = [Event("run", 0, 0, 5, "weights_loaded", {"weights_bytes": "900"}),
              Event("run", 2, 7, 9, "oom", {})]
    truth = truth_from("run-7", "oom", events, {0: RankSummary(0)}, [], {})
    assert truth.run_id == "run-7"
    assert [(r.rank, r.oom_step, r.non_torch_at_sizing_bytes, r.oom_margin_bytes, r.weights_bytes, r.kv_cache_bytes)
            for r in truth.ranks] == [(0, None, None, None, None, None), (2, 7, None, 0, None, None)]
    assert truth.to_dict()["weights_bytes"] is None and truth.to_dict()["kv_cache_bytes"] is None


def test_a_rank_that_sized_but_left_no_summary() -> None:
    """Rank 3 sized its KV cache (an engine that recorded no ``reserved_bytes``) and has no per-rank summary."""
    sizing = _sizing(3)
    del sizing.data["reserved_bytes"]
    truth = truth_from("run", "ok", [sizing], {}, [], {})
    (rank,) = truth.ranks
    # used − current at sizing: 2 GiB − 1 GiB, the cache slack included since reserved was not recorded
    assert (rank.rank, rank.non_torch_at_sizing_bytes, rank.oom_margin_bytes, rank.kv_cache_bytes) == (
        3, 1 * GIB, None, 200 * MIB)
