"""The router's policies on hand-written expositions, parsed by the Prometheus client's parser as a scrape is."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from memwatch.errors import UsageError
from memwatch.sim.fleet.engine import FleetEngine, FleetRequest
from memwatch.sim.fleet.policies import (
    POLICIES,
    EngineView,
    KvUsage,
    KvUsageQueue,
    MemwatchHeadroom,
    RoundRobin,
    make_policy,
)
from memwatch.sim.fleet.results import PolicyResult, percentile, render_table, summarize, versus_best
from memwatch.sim.fleet.scrape import keep_families, parse
from memwatch.sim.fleet.traces import from_text, parse_shape
from memwatch_engine.ring_reader import RingReader


def exposition(run: str, *, used: int, total: int = 100, waiting: int = 0, valid: int = 1,
               committed: float | None = None, admissible: dict[str, int] | None = None,
               safe: int | None = None, free_tokens: int | None = None, capacity: int | None = None,
               expected: float | None = None, share: float | None = None, ranks: int = 1) -> str:
    """A sidecar's text for one engine: the KV gauges per rank, the headroom gauges per engine."""
    lines = ["# HELP memwatch_kv_blocks_used KV cache blocks in use", "# TYPE memwatch_kv_blocks_used gauge"]
    lines += [f'memwatch_kv_blocks_used{{run_id="{run}",rank="{r}"}} {used + r}' for r in range(ranks)]
    lines += ["# TYPE memwatch_kv_blocks_capacity gauge"]
    lines += [f'memwatch_kv_blocks_capacity{{run_id="{run}",rank="{r}"}} {total}' for r in range(ranks)]
    lines += ["# TYPE memwatch_requests_waiting gauge", f'memwatch_requests_waiting{{run_id="{run}"}} {waiting}',
              "# TYPE memwatch_signal_valid gauge", f'memwatch_signal_valid{{run_id="{run}"}} {valid}']
    if committed is not None:
        lines += ["# TYPE memwatch_kv_committed_usage_ratio gauge",
                  f'memwatch_kv_committed_usage_ratio{{run_id="{run}"}} {committed}']
    if expected is not None:
        lines += ["# TYPE memwatch_kv_expected_usage_ratio gauge",
                  f'memwatch_kv_expected_usage_ratio{{run_id="{run}"}} {expected}']
    if share is not None:
        lines += ["# TYPE memwatch_expected_output_share gauge",
                  f'memwatch_expected_output_share{{run_id="{run}"}} {share}']
    if safe is not None:
        lines += ["# TYPE memwatch_max_safe_prefill_tokens gauge",
                  f'memwatch_max_safe_prefill_tokens{{run_id="{run}"}} {safe}']
    if free_tokens is not None:
        lines += ["# TYPE memwatch_kv_free_tokens gauge", f'memwatch_kv_free_tokens{{run_id="{run}"}} {free_tokens}']
    if capacity is not None:
        lines += ["# TYPE memwatch_kv_capacity_tokens gauge",
                  f'memwatch_kv_capacity_tokens{{run_id="{run}"}} {capacity}']
    lines += ["# TYPE memwatch_admissible_requests gauge"]
    lines += [f'memwatch_admissible_requests{{run_id="{run}",shape="{shape}"}} {n}'
              for shape, n in (admissible or {}).items()]
    return "\n".join(lines) + "\n"


def view(index: int, text: str) -> EngineView:
    return EngineView(index, f"r{index}", parse(text))


def request(prompt: int = 500, output: int = 100, rid: int = 0) -> FleetRequest:
    return FleetRequest(rid, prompt, output, 0)


def test_the_parser_reads_each_rank_and_the_view_takes_the_tightest() -> None:
    # Two ranks: 40 and 41 blocks used of 100; the engine's usage is the tighter rank's, 41 / 100.
    engine = view(0, exposition("r0", used=40, ranks=2) + exposition("other", used=90))
    assert engine.scrape is not None
    assert sorted(engine.scrape.values("memwatch_kv_blocks_used", run_id="r0")) == [40.0, 41.0]
    assert engine.kv_usage() == pytest.approx(0.41)
    assert engine.highest("memwatch_kv_blocks_used") == 41.0  # another run's series is not this engine's


def test_a_request_sent_counts_until_a_scrape_shows_a_sample_written_after_it() -> None:
    # The engine had written 7 samples when the router sent two requests; a long prefill step writes nothing
    # for the next scrapes, so they still count as sent there. The first sample after them (8) shows them.
    def scraped(samples: int) -> object:
        return parse(exposition("r0", used=10) + f'memwatch_samples_total{{run_id="r0",rank="0"}} {samples}\n')

    engine = EngineView(0, "r0", parse(exposition("r0", used=10)
                                       + 'memwatch_samples_total{run_id="r0",rank="0"} 7\n'))
    engine.send(request(rid=1))
    engine.send(request(rid=2))
    engine.rescraped(scraped(7))  # type: ignore[arg-type]
    assert [r.request_id for r in engine.sent] == [1, 2]
    engine.send(request(rid=3))
    engine.rescraped(scraped(8))  # type: ignore[arg-type]
    assert engine.sent == [] and engine.sent_marks == []
    # A scrape without the count (an older sidecar) cannot show them: nothing is kept past it either way.
    engine.send(request(rid=4))
    engine.rescraped(parse(exposition("r0", used=10)))
    assert engine.sent == []


def test_round_robin_takes_turns_and_skips_an_engine_that_is_down() -> None:
    policy = RoundRobin(random.Random(0))
    views = [view(i, exposition(f"r{i}", used=0)) for i in range(3)]
    assert [policy.choose(request(), views) for _ in range(4)] == [0, 1, 2, 0]
    assert [policy.choose(request(), [views[0], views[2]]) for _ in range(3)] == [2, 0, 2]


def test_kv_usage_takes_the_least_used_unsaturated_engine() -> None:
    # Usage 0.30, 0.10 (but 5 waiting: saturated), 0.79 and 0.85 (saturated): engine 0 wins over engine 2.
    views = [view(0, exposition("r0", used=30)), view(1, exposition("r1", used=10, waiting=5)),
             view(2, exposition("r2", used=79)), view(3, exposition("r3", used=85))]
    assert KvUsage(random.Random(0)).choose(request(), views) == 0
    # Four sent since the scrape make engine 0's queue 4, still under 5; a fifth saturates it.
    views[0].sent = [request()] * 4
    assert KvUsage(random.Random(0)).choose(request(), views) == 0
    views[0].sent.append(request())
    assert KvUsage(random.Random(0)).choose(request(), views) == 2


def test_kv_usage_with_every_engine_saturated_still_routes_to_the_least_used() -> None:
    views = [view(0, exposition("r0", used=95)), view(1, exposition("r1", used=82))]
    assert KvUsage(random.Random(0)).choose(request(), views) == 1


def test_kv_usage_queue_holds_the_request_at_the_router_only_when_every_engine_is_saturated() -> None:
    # Usage 0.95 and 0.82: both at or over 0.8, so the request waits at the router (None) where kv-usage sends it.
    views = [view(0, exposition("r0", used=95)), view(1, exposition("r1", used=82))]
    assert KvUsageQueue(random.Random(0)).choose(request(), views) is None
    assert make_policy("kv-usage-queue", random.Random(0)).choose(request(), views) is None
    # One engine under both thresholds (0.79, 4 waiting): it takes the request as kv-usage would.
    views.append(view(2, exposition("r2", used=79, waiting=4)))
    assert KvUsageQueue(random.Random(0)).choose(request(), views) == 2
    # The request the router sent there since the scrape makes its queue 5: saturated too, so held again.
    views[2].sent = [request()]
    assert KvUsageQueue(random.Random(0)).choose(request(), views) is None
    assert KvUsageQueue(random.Random(0)).choose(request(), []) is None


def test_each_policy_is_judged_against_the_best_baseline_on_each_measure() -> None:
    # Baselines: kv-usage 100 tokens/s with p99 queue 4 s, kv-usage-queue 80 tokens/s with p99 2 s. The best
    # baseline's tokens/s is 100 and its p99 2 s, from two different policies: memwatch's 98 tokens/s and
    # 2.4 s read 0.98 and 1.2.
    rows = [PolicyResult(policy=policy, trace="t", engines=2, seed=1, requests=10, completed=10, ooms=0,
                         preemptions=0, p50_queue_s=0.1, p99_queue_s=p99, tokens_per_s=rate, lost=0, rejected=0,
                         simulated_s=10.0)
            for policy, rate, p99 in (("kv-usage", 100.0, 4.0), ("kv-usage-queue", 80.0, 2.0), ("memwatch", 98.0, 2.4))]
    ratios = versus_best(rows, ("round-robin", "kv-usage", "kv-usage-queue"))
    assert ratios["memwatch"] == {"tokens_per_s_ratio": 0.98, "p99_queue_ratio": 1.2}
    assert ratios["kv-usage"] == {"tokens_per_s_ratio": 1.0, "p99_queue_ratio": 2.0}
    table = render_table(rows, ("round-robin", "kv-usage", "kv-usage-queue"))
    assert "tokens/s ÷ best" in table and "best of kv-usage, kv-usage-queue on each measure" in table
    assert "0.98" in table.splitlines()[4] and "1.20" in table.splitlines()[4]
    # No baseline ran: no ratio column, and ratios cannot be formed.
    assert "÷" not in render_table(rows[2:], ("kv-usage",))
    assert versus_best(rows[2:], ("kv-usage",))["memwatch"] == {"tokens_per_s_ratio": None, "p99_queue_ratio": None}


def test_memwatch_filters_on_kv_and_safe_prefill_then_scores_committed_usage() -> None:
    # Each engine: 100 blocks, 10 used, 9,000 free tokens: 10,000 tokens in all.
    policy = MemwatchHeadroom(random.Random(0))
    views = [
        # committed 0.95: 500 tokens neither used nor promised
        view(0, exposition("r0", used=10, committed=0.95, free_tokens=9000, safe=9000)),
        view(1, exposition("r1", used=10, committed=0.50, free_tokens=9000, safe=9000)),  # 5,000 tokens
        view(2, exposition("r2", used=10, committed=0.40, free_tokens=9000, safe=2000)),  # 6,000 tokens
    ]
    # 500 + 100 tokens: over engine 0's 500; engine 2 has the lower committed usage.
    assert policy.choose(request(500, 100), views) == 2
    # A 3,000-token prompt: engine 2's safe prefill (2,000) is below it: engine 1.
    assert policy.choose(request(3000, 800), views) == 1
    # Sent to engine 1 since the scrape: 3,800 tokens, so 3,800 + 3,800 > 5,000 and the next waits.
    views[1].sent = [request(3000, 800)]
    assert policy.choose(request(3000, 800), views) is None
    # A small request still fits engine 1's KV (3,800 + 600 <= 5,000), but its prompt and the 3,000 sent
    # may be prefilled in one forward: 3,500 <= 9,000, admitted; with a safe prefill of 3,400 it waits.
    assert policy.choose(request(500, 100), views[1:2]) == 1
    views[1] = view(1, exposition("r1", used=10, committed=0.50, free_tokens=9000, safe=3400))
    views[1].sent = [request(3000, 800)]
    assert policy.choose(request(500, 100), views[1:2]) is None
    # Two requests waiting at the engine may be prefilled with it too, each counted as its size: with a safe
    # prefill of 3,000, a 1,000-token prompt fits (3 x 1,000), a 1,001-token one does not.
    queued = view(2, exposition("r2", used=10, committed=0.10, free_tokens=9000, safe=3000, waiting=2))
    assert policy.choose(request(1000, 10), [queued]) == 2
    assert policy.choose(request(1001, 10), [queued]) is None


def test_memwatch_checks_each_request_on_its_own_size() -> None:
    # Both engines: 100 blocks, 50 used, 25,600 free tokens, so 51,200 tokens in all. Engine 0: committed 0.30,
    # so 35,840 tokens neither used nor promised, but 5 waiting ahead: 6 x 6,000 = 36,000 > 35,840, refused.
    # Engine 1: committed 0.50, 25,600 tokens, nobody waiting: 6,000 fits, though its committed usage is higher.
    # The admissible gauge for a large shape says 9 on both: the policy checks the request's own size instead.
    policy = MemwatchHeadroom(random.Random(0))
    views = [view(0, exposition("r0", used=50, committed=0.30, waiting=5, admissible={"8192:2048": 9},
                                free_tokens=25_600)),
             view(1, exposition("r1", used=50, committed=0.50, admissible={"8192:2048": 9}, free_tokens=25_600))]
    assert policy.choose(request(5000, 1000), views) == 1
    # Three sent to engine 1 since the scrape: 18,000 + 6,000 = 24,000 <= 25,600 still fits; a fourth does not.
    views[1].sent = [request(5000, 1000)] * 3
    assert policy.choose(request(5000, 1000), views) == 1
    views[1].sent.append(request(5000, 1000))
    assert policy.choose(request(5000, 1000), views) is None
    # A full cache admits nothing; gauges that cannot tell (no free tokens exported) refuse nobody.
    full = view(2, exposition("r2", used=100, committed=1.0, free_tokens=0))
    assert policy.choose(request(5000, 1000), [full]) is None
    assert policy.choose(request(5000, 1000), [view(3, exposition("r3", used=50, committed=0.9))]) == 3


def test_memwatch_sizes_the_cache_from_the_sample_its_free_tokens_come_from() -> None:
    """An engine that just emptied: its newest sample has all 6,272 tokens free (49 blocks of 128), while the
    stored sample behind ``memwatch_kv_blocks_used`` still says 36 of 49 blocks used. Free tokens over the free
    fraction make a cache of 6,272 / (13 / 49) = 23,641 tokens; the capacity gauge says 6,272. Committed 0.5:
    3,136 tokens neither used nor promised, so one request of 2,000 fits and a second sent after it does not."""
    policy = MemwatchHeadroom(random.Random(0))
    stale = exposition("r0", used=36, total=49, committed=0.5, free_tokens=6272, capacity=6272)
    engine = view(0, stale)
    assert policy.choose(request(1500, 500), [engine]) == 0
    engine.sent = [request(1500, 500)]
    assert policy.choose(request(1500, 500), [engine]) is None  # 2,000 + 2,000 > 3,136
    # Without the capacity gauge (an older sidecar), the mixed estimate: 23,641 × 0.5 = 11,820 tokens, admitted.
    older = view(0, exposition("r0", used=36, total=49, committed=0.5, free_tokens=6272))
    older.sent = [request(1500, 500)]
    assert policy.choose(request(1500, 500), [older]) == 0


def test_memwatch_without_a_valid_signal_routes_as_kv_usage() -> None:
    policy = MemwatchHeadroom(random.Random(0))
    views = [view(0, exposition("r0", used=50, valid=0, committed=0.0, free_tokens=9999)),
             view(1, exposition("r1", used=20, valid=0, committed=0.9, free_tokens=0))]
    assert policy.choose(request(), views) == 1


def test_memwatch_counts_what_it_sent_against_committed_usage() -> None:
    # Both engines: 100 blocks, 50 used, 25,600 free tokens, so 51,200 tokens in all. Engine 0 is at 0.60
    # committed, engine 1 at 0.62; after one 5,000 + 1,000 token request sent to engine 0 it stands at
    # 0.60 + 6,000 / 51,200 = 0.717, so the next goes to engine 1.
    policy = MemwatchHeadroom(random.Random(0))
    views = [view(i, exposition(f"r{i}", used=50, committed=c, free_tokens=25_600))
             for i, c in enumerate((0.60, 0.62))]
    assert policy.choose(request(5000, 1000), views) == 0
    views[0].sent = [request(5000, 1000)]
    assert policy.choose(request(5000, 1000), views) == 1


def test_shapes_and_policy_names() -> None:
    assert parse_shape("2048:512", "here") == (2048, 512)
    for bad in ("2048", "0:5", "a:b", "-1:3"):
        with pytest.raises(UsageError, match="PROMPT:OUTPUT"):
            parse_shape(bad, "here")
    with pytest.raises(UsageError, match="unknown router policy 'least-load'"):
        make_policy("least-load", random.Random(0))
    assert [make_policy(name, random.Random(0)).name for name in POLICIES] == list(POLICIES)


def test_a_trace_file_with_a_fleet_table() -> None:
    text = """
model = "Qwen3-0.6B"
[gpu]
total_bytes = 8_589_934_592
[[workload.requests]]
prompt_tokens = 100
output_tokens = 10
[fleet]
admission_shapes = ["512:64"]
[[fleet.engine_faults]]
engine = 1
kind = "other_process"
size_bytes = 1_000_000
at_step = 3
"""
    trace = from_text(text, source="t.toml")
    assert trace.shapes == ((512, 64),)
    assert [f.kind for f in trace.faults_of(0)] == [] and [f.kind for f in trace.faults_of(1)] == ["other_process"]
    with pytest.raises(UsageError, match="a fault of engine 1, but the fleet has 1 engines"):
        trace.check(1)
    with pytest.raises(UsageError, match=r"unknown key 'engines'"):
        from_text(text.replace("admission_shapes", "engines"), source="t.toml")


def test_percentiles_and_the_table() -> None:
    # Nearest rank: of 1..10, p50 is the 5th value, p99 the 10th.
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == 5.0 and percentile(values, 99) == 10.0 and percentile([], 50) is None
    # 3 completed requests, 900 output tokens, the last done 4.5 s in: 200 tokens/s.
    result = summarize("kv-usage", "t", 2, 0, 4, [0, 1_000_000_000, 2_000_000_000], 900, 4_500_000_000,
                       ooms=1, preemptions=7, lost=1, rejected=0, simulated_ns=5_000_000_000)
    assert (result.completed, result.p50_queue_s, result.p99_queue_s, result.tokens_per_s) == (3, 1.0, 2.0, 200.0)
    assert "kv-usage" in render_table([result]) and "200.0" in render_table([result])


def test_the_scrape_keeps_whole_families_by_exact_name() -> None:
    text = ("# HELP memwatch_kv_blocks_used KV cache blocks in use\n# TYPE memwatch_kv_blocks_used gauge\n"
            'memwatch_kv_blocks_used{run_id="a"} 7\n'
            "# TYPE memwatch_kv_blocks_used_total counter\nmemwatch_kv_blocks_used_total 9\n"
            "# TYPE memwatch_signal_valid gauge\nmemwatch_signal_valid 1\n")
    kept = keep_families(text, frozenset({"memwatch_kv_blocks_used", "memwatch_signal_valid"}))
    assert kept.splitlines() == [line for line in text.splitlines() if "_used_total" not in line]
    scrape = parse(text, frozenset({"memwatch_kv_blocks_used"}))
    assert dict(scrape.samples) == {"memwatch_kv_blocks_used": [({"run_id": "a"}, 7.0)]}


def test_no_policy_is_told_where_an_output_stops() -> None:
    """Every policy decides on a request's prompt and ``max_tokens``: the same scrapes and draws give the same
    choices whether the request stops after one output, runs to its ``max_tokens`` or does not say."""
    rng = random.Random(7)
    for name in POLICIES:
        for trial in range(40):
            texts = [exposition(f"r{i}", used=rng.randint(0, 100), waiting=rng.randint(0, 6), committed=rng.random(),
                                free_tokens=rng.randint(0, 9000), safe=rng.randint(0, 9000)) for i in range(3)]
            prompt, output = rng.randint(1, 4000), rng.randint(1, 2000)
            choices = set()
            for stop in (None, 1, output):
                views = [view(i, text) for i, text in enumerate(texts)]
                views[0].sent = [FleetRequest(9, 700, 300, 0, stop)]
                choices.add(make_policy(name, random.Random(trial)).choose(FleetRequest(0, prompt, output, 0, stop),
                                                                             views))
            assert len(choices) == 1, (name, trial, choices)


def test_an_engine_records_a_request_s_max_tokens_never_its_stop(tmp_path: Path) -> None:
    """What the sidecar (and through it the router) learns of a request is its prompt and ``max_tokens``: the
    stop shows only as the request finishing."""
    trace = from_text(STOPPING, source="stopping.toml")
    engine = FleetEngine(0, trace.scenario, (), tmp_path, 1_700_000_000_000_000_000, "stops0001")
    engine.start()
    ring = RingReader(engine.ring_paths[0])
    try:
        start = engine.clock.now_ns()
        engine.submit(FleetRequest(0, 300, 100, 0, stop_tokens=3), start)
        engine.advance_to(start + 2_000_000_000)
        events = [(kind, data) for _seq, _step, _ts, kind, data in ring.drain(0).events
                  if kind in ("request_arrived", "request_finished")]
        assert events == [("request_arrived", {"request_id": 0, "prompt_tokens": 300, "max_tokens": 100}),
                          ("request_finished", {"request_id": 0, "output_tokens": 3})]
    finally:
        ring.close()
        engine.close()


STOPPING = """
name = "stopping"
model = "Qwen3-0.6B"
[gpu]
total_bytes = 8_589_934_592
[engine]
max_num_batched_tokens = 4096
max_model_len = 8192
[workload.random]
count = 1
prompt_tokens_min = 300
prompt_tokens_max = 300
output_tokens_min = 100
output_tokens_max = 100
"""


def test_every_shipped_trace_stops_outputs_before_max_tokens() -> None:
    """Each trace draws where its outputs stop (``stop_fraction_min``): most end before their ``max_tokens``."""
    from memwatch.sim.fleet import load_trace
    from memwatch.sim.fleet.traces import shipped_traces

    for name in shipped_traces():
        stopping = [r for r in load_trace(name).requests(1) if r.stop_tokens is not None]
        assert sum(r.stop_tokens < r.output_tokens for r in stopping) > len(stopping) / 2, name  # type: ignore[operator]


def test_the_original_traces_stop_within_their_stated_shares() -> None:
    from memwatch.sim.fleet import load_trace

    # Bursty long context: every output stops after 50 to 100 % of its max_tokens, 75 % on average.
    requests = load_trace("fleet_bursty_long_context").requests(1)
    shares = [r.stop_tokens / r.output_tokens for r in requests if r.stop_tokens is not None]
    assert len(shares) == len(requests) == 60
    assert min(shares) >= 0.5 and max(shares) <= 1.0 and 0.65 < sum(shares) / 60 < 0.85
    # Long prefill: the 80 chat requests stop after 20 to 100 %, 60 % on average; the 8 documents run to 64.
    requests = load_trace("fleet_long_prefill").requests(1)
    documents = [r for r in requests if r.prompt_tokens == 9000]
    assert len(documents) == 8 and all(r.stop_tokens is None and r.generated_tokens == 64 for r in documents)
    shares = [r.stop_tokens / r.output_tokens for r in requests if r.stop_tokens is not None]
    assert len(shares) == 80 and min(shares) >= 0.2 and 0.5 < sum(shares) / 80 < 0.7
