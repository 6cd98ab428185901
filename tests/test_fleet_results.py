"""The fleet's results: nearest-rank percentiles, the rounding of each figure, the ratios to the best baseline
and the table, on hand-made counts."""

from __future__ import annotations

import dataclasses

from memwatch.sim.fleet.results import PolicyResult, percentile, render_table, summarize, versus_best


def result(policy: str, *, completed: int = 10, ooms: int = 0, preemptions: int = 0, p50: float | None = 0.1,
           p99: float | None = 1.0, rate: float = 100.0, lost: int = 0, rejected: int = 0) -> PolicyResult:
    return PolicyResult(policy=policy, trace="bursty", engines=4, seed=7, requests=1240, completed=completed,
                        ooms=ooms, preemptions=preemptions, p50_queue_s=p50, p99_queue_s=p99, tokens_per_s=rate,
                        lost=lost, rejected=rejected, simulated_s=60.0)


def test_nearest_rank_percentiles() -> None:
    # Of 1..101, the median is the 51st value (50.5 rounds up); q = 0 is still the smallest value, not the second.
    assert percentile([float(v) for v in range(1, 102)], 50) == 51.0
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([], 99) is None


def test_summarize_rounds_each_figure_and_reads_p50_and_p99() -> None:
    # 100 requests queued 1 s + 123,456 ns, 2 s + 123,456 ns, ... : p50 is the 50th, p99 the 99th, to 4 digits.
    # 1,000 output tokens by 3 s: 333.33 tokens/s; 12,345,678,901 ns simulated: 12.346 s.
    queue_ns = [i * 1_000_000_000 + 123_456 for i in range(1, 101)]
    done = summarize("memwatch", "bursty", 4, 7, 120, queue_ns, 1000, 3_000_000_000, ooms=1, preemptions=2, lost=3,
                     rejected=4, simulated_ns=12_345_678_901)
    assert done.to_dict() == {"policy": "memwatch", "trace": "bursty", "engines": 4, "seed": 7, "requests": 120,
                              "completed": 100, "ooms": 1, "preemptions": 2, "p50_queue_s": 50.0001,
                              "p99_queue_s": 99.0001, "tokens_per_s": 333.33, "lost": 3, "rejected": 4,
                              "simulated_s": 12.346}
    # Nothing completed: no percentiles and no rate (the last completion is at 0).
    empty = summarize("kv-usage", "bursty", 4, 7, 120, [], 0, 0, ooms=0, preemptions=0, lost=0, rejected=120,
                      simulated_ns=0)
    assert (empty.completed, empty.p50_queue_s, empty.p99_queue_s, empty.tokens_per_s) == (0, None, None, 0.0)
    # One token finished 1 ns in is a rate, however absurd: 1e9 tokens/s.
    assert summarize("kv-usage", "t", 1, 0, 1, [0], 1, 1, ooms=0, preemptions=0, lost=0, rejected=0,
                     simulated_ns=1).tokens_per_s == 1e9


def test_ratios_to_the_best_baseline_at_three_digits_and_small_figures() -> None:
    # Best rate 100: 98.76 reads 0.988. Best p99 3 s: 1 s reads 0.333.
    rows = [result("kv-usage", rate=100.0, p99=3.0), result("memwatch", rate=98.76, p99=1.0)]
    assert versus_best(rows, ("kv-usage",))["memwatch"] == {"tokens_per_s_ratio": 0.988, "p99_queue_ratio": 0.333}
    # A best baseline under 1 token/s and under 1 s is still a figure to divide by.
    rows = [result("kv-usage", rate=0.5, p99=0.5), result("memwatch", rate=0.25, p99=1.0)]
    assert versus_best(rows, ("kv-usage",))["memwatch"] == {"tokens_per_s_ratio": 0.5, "p99_queue_ratio": 2.0}
    # A best p99 of 0 (nothing ever queued) or a rate of 0: no ratio can be formed.
    rows = [result("kv-usage", rate=0.0, p99=0.0), result("memwatch", rate=10.0, p99=1.0)]
    assert versus_best(rows, ("kv-usage",))["memwatch"] == {"tokens_per_s_ratio": None, "p99_queue_ratio": None}


def test_the_table_line_by_line() -> None:
    rows = [result("kv-usage", completed=1234, ooms=1, preemptions=2345, p50=0.1234, p99=2.0, rate=1234.56, lost=3),
            result("memwatch", completed=1234, p50=None, p99=1.0, rate=1000.0, rejected=5)]
    # memwatch: 1,000 / 1,234.56 = 0.810 of the best rate, 1 / 2 of the best p99; kv-usage is the best on both.
    head = "policy         completed ooms preemptions p50 queue s p99 queue s  tokens/s lost rejected"
    assert render_table(rows, ("round-robin", "kv-usage")).splitlines() == [
        "trace bursty: 1,240 requests, 4 engines, seed 7",
        head + " tokens/s ÷ best p99 ÷ best",
        "kv-usage           1,234    1       2,345        0.12        2.00   1,234.6    3        0"
        "            1.00       1.00",
        "memwatch           1,234    0           0           -        1.00   1,000.0    0        5"
        "            0.81       0.50",
        "best baseline: the best of kv-usage on each measure (highest tokens/s, lowest p99 queue)",
    ]
    # No baseline ran: the same columns without the ratios, and no footer.
    assert render_table(rows).splitlines() == [
        "trace bursty: 1,240 requests, 4 engines, seed 7",
        head,
        "kv-usage           1,234    1       2,345        0.12        2.00   1,234.6    3        0",
        "memwatch           1,234    0           0           -        1.00   1,000.0    0        5",
    ]
    assert render_table([]) == "no policy ran"
    one = dataclasses.replace(rows[0], requests=1, engines=1)
    assert render_table([one]).splitlines()[0] == "trace bursty: 1 request, 1 engine, seed 7"
