"""The router's policies at their edges: another run's series, an engine not yet scraped, each threshold exactly
met, the expected usage a sidecar exports, and the ties. Hand-written expositions, numbers derived by hand."""

from __future__ import annotations

import random

import pytest
from test_fleet_policies import exposition, request, view

from memwatch.errors import UsageError
from memwatch.sim.fleet.policies import READ, EngineView, KvUsage, KvUsageQueue, MemwatchHeadroom, make_policy
from memwatch.sim.fleet.scrape import parse


def samples(run: str, count: int) -> str:
    return f'memwatch_samples_total{{run_id="{run}",rank="0"}} {count}\n'


def test_a_view_reads_only_its_own_run_and_the_labels_it_asks_for() -> None:
    # r0: two ranks at 40 and 41 blocks of 100, valid, 7 samples; another run on the same scrape: 50 blocks in
    # all, invalid, 9 samples. The view of r0 sees none of the other run's series.
    text = exposition("r0", used=40, ranks=2) + exposition("other", used=5, total=50, valid=0)
    engine = EngineView(0, "r0", parse(text + samples("r0", 7) + samples("other", 9)))
    assert engine.lowest("memwatch_kv_blocks_capacity") == 100.0
    assert engine.lowest("memwatch_signal_valid") == 1.0
    assert engine.lowest("memwatch_kv_blocks_used", rank="1") == 41.0
    assert engine.highest("memwatch_kv_blocks_used", rank="0") == 40.0
    # A request sent at r0's count of 7 is not shown by a scrape where r0 still says 7 (the other run's 9 is not
    # r0's count): it still counts as sent.
    engine.send(request(rid=1))
    engine.rescraped(parse(text + samples("r0", 7) + samples("other", 9)))
    assert [r.request_id for r in engine.sent] == [1] and engine.sent_marks == [7.0]


def test_an_engine_not_yet_scraped_reads_nothing_and_any_count_shows_what_was_sent_to_it() -> None:
    fresh = EngineView(0, "r0")
    assert fresh.lowest("memwatch_signal_valid") is None and fresh.highest("memwatch_kv_blocks_used") is None
    assert fresh.kv_usage() is None
    # Sent before the router had any count: the first scrape with a count, even 0, shows it.
    fresh.send(request(rid=1))
    assert fresh.sent_marks == [-1.0]
    fresh.rescraped(parse(exposition("r0", used=10) + samples("r0", 0)))
    assert fresh.sent == [] and fresh.sent_marks == []
    assert fresh.kv_usage() == pytest.approx(0.10)  # the view reads the new scrape


def test_a_view_whose_marks_do_not_pair_with_its_requests_fails_loudly() -> None:
    engine = EngineView(0, "r0", parse(exposition("r0", used=10)), sent=[request()], sent_marks=[])
    with pytest.raises(ValueError, match="zip"):
        engine.rescraped(parse(exposition("r0", used=10) + samples("r0", 3)))


def test_an_engine_whose_usage_cannot_be_told_reads_as_empty_to_kv_usage() -> None:
    # No blocks yet (capacity 0) and no scrape at all: no usage, not a division by zero.
    assert view(0, exposition("r0", used=0, total=0)).kv_usage() is None
    assert EngineView(1, "r1", parse("")).kv_usage() is None
    # kv-usage counts an unknown usage as 0: the unscraped engine beats one at 0.30.
    assert KvUsage(random.Random(0)).choose(request(), [EngineView(0, "r0"), view(1, exposition("r1", used=30))]) == 0
    assert KvUsage(random.Random(0)).choose(request(), []) is None


def test_kv_usage_is_saturated_at_exactly_80_percent() -> None:
    assert KvUsageQueue(random.Random(0)).choose(request(), [view(0, exposition("r0", used=80))]) is None
    assert KvUsageQueue(random.Random(0)).choose(request(), [view(0, exposition("r0", used=79))]) == 0


def test_memwatch_safe_prefill_bound_is_inclusive_and_an_empty_queue_counts_the_request_once() -> None:
    policy = MemwatchHeadroom(random.Random(0))
    engine = view(0, exposition("r0", used=10, committed=0.2, safe=1000))
    assert policy.choose(request(1000, 10), [engine]) == 0
    assert policy.choose(request(1001, 10), [engine]) is None
    # An engine refused on its safe prefill does not end the search: the next one still takes it.
    views = [view(0, exposition("r0", used=10, committed=0.2, safe=500)),
             view(1, exposition("r1", used=10, committed=0.2, safe=9000))]
    assert policy.choose(request(1000, 10), views) == 1


def test_memwatch_ranks_an_engine_without_committed_usage_as_full() -> None:
    # No free tokens exported: neither engine can be refused on KV. Engine 0 exports no committed usage and
    # ranks at 1.0; engine 1 says 0.9 and wins; engine 2 says it is overcommitted (1.2) and loses to engine 0.
    policy = MemwatchHeadroom(random.Random(0))
    unknown = view(0, exposition("r0", used=10))
    assert policy.choose(request(), [unknown, view(1, exposition("r1", used=10, committed=0.9))]) == 1
    assert policy.choose(request(), [unknown, view(2, exposition("r2", used=10, committed=1.2))]) == 0


def test_memwatch_uses_the_expected_usage_and_output_share_where_both_are_exported() -> None:
    # Both engines: 10,000 tokens, committed 0.9 (1,000 tokens unpromised in the worst case), expected 0.30 and
    # 0.48 with half of max_tokens expected: a 1,000 + 1,000 request is 1,500 tokens. Engine 0 has one such
    # request sent: 1,500 + 1,500 <= 7,000 fits, and it ranks at 0.30 + 1,500 / 10,000 = 0.45 < 0.48.
    def engine(index: int, expected: float | None, share: float | None) -> EngineView:
        return view(index, exposition(f"r{index}", used=20, committed=0.9, free_tokens=8000, capacity=10_000,
                                      expected=expected, share=share))

    policy = MemwatchHeadroom(random.Random(0))
    views = [engine(0, 0.30, 0.5), engine(1, 0.48, 0.5)]
    views[0].sent = [request(1000, 1000)]
    assert policy.choose(request(1000, 1000), views) == 0
    # Only one of the two exported: the worst case, committed 0.9 and every output to max_tokens: 2,000 tokens
    # do not fit in 1,000.
    assert policy.choose(request(1000, 1000), [engine(0, 0.30, None)]) is None
    assert policy.choose(request(1000, 1000), [engine(0, None, 0.5)]) is None


def test_memwatch_breaks_a_tie_on_committed_usage_with_the_larger_safe_prefill() -> None:
    # Same committed usage; the larger safe prefill wins whatever the draw. An engine without the gauge counts
    # as 0 tokens: even a safe prefill of 1 token beats it, for a 1-token prompt.
    for seed in range(20):
        policy = MemwatchHeadroom(random.Random(seed))
        views = [view(0, exposition("r0", used=10, committed=0.5, safe=4000)),
                 view(1, exposition("r1", used=10, committed=0.5, safe=8000))]
        assert policy.choose(request(1000, 10), views) == 1
        views = [view(0, exposition("r0", used=10, committed=0.5)),
                 view(1, exposition("r1", used=10, committed=0.5, safe=1))]
        assert policy.choose(request(1, 10), views) == 1, seed


def test_memwatch_kv_check_is_inclusive_and_a_capacity_of_zero_cannot_tell() -> None:
    policy = MemwatchHeadroom(random.Random(0))
    # 10,000 tokens at committed 0.5: 5,000 unpromised. 4,000 + 1,000 fits exactly; one token more does not.
    engine = view(0, exposition("r0", used=50, committed=0.5, free_tokens=5000, capacity=10_000))
    assert policy.choose(request(4000, 1000), [engine]) == 0
    assert policy.choose(request(4001, 1000), [engine]) is None
    # A capacity gauge of 0 and no blocks (an engine not yet profiled): the cache cannot be told, not refused.
    empty = view(0, exposition("r0", used=0, total=0, committed=0.5, free_tokens=0, capacity=0))
    assert policy.choose(request(), [empty]) == 0
    # A capacity of 1 token is a cache, though a tiny one: a 600-token request does not fit in it.
    tiny = view(0, exposition("r0", used=0, total=0, committed=0.5, free_tokens=0, capacity=1))
    assert policy.choose(request(), [tiny]) is None


def test_memwatch_with_requests_sent_to_an_engine_whose_cache_cannot_be_told() -> None:
    # No free tokens and no capacity: nothing to check the sent requests against; the engine still takes more.
    engine = view(0, exposition("r0", used=50, committed=0.5))
    engine.sent = [request(5000, 1000)] * 2
    assert MemwatchHeadroom(random.Random(0)).choose(request(), [engine]) == 0


def test_memwatch_adds_the_sent_share_as_a_fraction_of_the_cache() -> None:
    # 51,200 tokens each: engine 0 at 0.60 with 6,000 tokens sent reads 0.60 + 6,000 / 51,200 = 0.717, still
    # under engine 1's 0.75, so it takes the next one too.
    views = [view(i, exposition(f"r{i}", used=50, committed=c, free_tokens=25_600)) for i, c in enumerate((0.60, 0.75))]
    views[0].sent = [request(5000, 1000)]
    assert MemwatchHeadroom(random.Random(0)).choose(request(5000, 1000), views) == 0


def test_an_unknown_policy_names_every_known_one() -> None:
    with pytest.raises(UsageError) as raised:
        make_policy("least-load", random.Random(0))
    assert str(raised.value) == ("unknown router policy 'least-load'; use one of round-robin, kv-usage, "
                                 "kv-usage-queue, memwatch, or all to compare them")


def test_the_router_s_scrape_keeps_every_family_the_memwatch_policy_reads() -> None:
    """The router scrapes only the families in ``READ``: the cache's size in tokens must be among them, or the
    policy sizes the cache from free tokens over a stale blocks-used fraction, the mix the capacity gauge is there
    to avoid. The engine that just emptied (6,272 tokens, committed 0.5: 3,136 unpromised) with 2,000 tokens sent
    admits no second request of 2,000."""
    stale = exposition("r0", used=36, total=49, committed=0.5, free_tokens=6272, capacity=6272)
    engine = EngineView(0, "r0", parse(stale, READ))
    engine.sent = [request(1500, 500)]
    assert MemwatchHeadroom(random.Random(0)).choose(request(1500, 500), [engine]) is None
