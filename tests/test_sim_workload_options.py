"""The workload's optional draws, each against what its definition implies by hand: heavy-tailed prompts, a
diurnal arrival rate, and requests that stop before their ``max_tokens``."""

from __future__ import annotations

import math
import statistics

import pytest

from memwatch.errors import UsageError
from memwatch.sim.blocks import BlockManager
from memwatch.sim.scheduler import Scheduler
from memwatch.sim.sequence import Sequence
from memwatch.sim.workload import RandomRequests, Workload


def spec(**options: object) -> RandomRequests:
    base: dict[str, object] = {"count": 4000, "prompt_tokens_min": 1, "prompt_tokens_max": 8000,
                               "output_tokens_min": 100, "output_tokens_max": 100, "rate_per_s": 1.0}
    return RandomRequests(**{**base, **options})  # type: ignore[arg-type]


def test_lognormal_prompts_have_their_median_and_their_clipped_tail() -> None:
    # Median 1,000, sigma 1: half the prompts under 1,000; P(X > 8,000) = P(Z > ln 8) = P(Z > 2.079) = 1.88 %,
    # and those are clipped to the maximum, 8,000.
    drawn = Workload(random=spec(prompt_tokens_median=1000, prompt_tokens_sigma=1.0)).generate(7)
    prompts = [r.prompt_tokens for r in drawn]
    assert 900 <= statistics.median(prompts) <= 1100
    assert min(prompts) >= 1 and max(prompts) == 8000
    clipped = sum(p == 8000 for p in prompts) / len(prompts)
    assert 0.012 <= clipped <= 0.026
    # The same seed draws the same stream; a uniform spec draws no lognormal.
    assert [r.prompt_tokens for r in Workload(random=spec(prompt_tokens_median=1000,
                                                          prompt_tokens_sigma=1.0)).generate(7)] == prompts


def test_a_diurnal_rate_ramps_from_its_trough_to_its_peak() -> None:
    # rate(t) = 1 - cos(2 pi t / P) with P = 4,000 s: the expected arrivals in [0, P/4] are
    # P/4 - P/(2 pi) = 363.4 and in [P/4, P/2] P/4 + P/(2 pi) = 1,636.6, 4.5 times as many.
    period = 4000.0
    drawn = Workload(random=spec(count=3000, diurnal_period_s=period, diurnal_amplitude=1.0)).generate(3)
    at = [r.arrival_ns / 1e9 for r in drawn]
    first = sum(t < period / 4 for t in at)
    second = sum(period / 4 <= t < period / 2 for t in at)
    assert 363.4 * 0.85 <= first <= 363.4 * 1.15
    assert 1636.6 * 0.9 <= second <= 1636.6 * 1.1
    assert at == sorted(at)


def test_requests_stop_between_their_fraction_and_their_max_tokens() -> None:
    # Outputs of 100 with stop_fraction_min 0.2: each stops after 20 to 100 outputs, 60 on average.
    drawn = Workload(random=spec(stop_fraction_min=0.2)).generate(5)
    stops = [r.stop_tokens for r in drawn]
    assert all(r.output_tokens == 100 for r in drawn)
    assert all(s is not None and 20 <= s <= 100 for s in stops)
    assert 58 <= statistics.mean(s for s in stops if s is not None) <= 62
    assert {min(stops), max(stops)} == {20, 100}  # type: ignore[type-var]
    assert all(r.generated_tokens == r.stop_tokens for r in drawn)


def test_without_the_options_a_stream_draws_what_it_always_drew() -> None:
    # The draws in their fixed order (gap, each request's prompt and output), as before the options existed.
    import random

    rng, expected, clock = random.Random(11), [], 0.0
    for _ in range(50):
        clock += rng.expovariate(0.5)
        expected.append((round(clock * 1e9), rng.randint(10, 500), rng.randint(5, 50)))
    drawn = Workload(random=RandomRequests(50, 10, 500, 5, 50, rate_per_s=0.5)).generate(11)
    assert [(r.arrival_ns, r.prompt_tokens, r.output_tokens) for r in drawn] == expected
    assert all(r.stop_tokens is None and r.generated_tokens == r.output_tokens for r in drawn)


def test_an_engine_finishes_a_request_at_its_stop_but_plans_for_its_max_tokens() -> None:
    # 16-token blocks; a 20-token prompt with max_tokens 30 and a stop after 3 outputs. While it runs the
    # scheduler's load counts what it would need to reach 50 tokens: ceil(50/16) = 4 blocks in all.
    manager = BlockManager(10, 16)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    seq = Sequence(0, 20, 30, stop_tokens=3)
    scheduler.add(seq)
    finished_at = None
    for step in range(1, 10):
        seqs, is_prefill = scheduler.schedule()
        if step == 1:  # after the prefill's schedule: 2 blocks held, 2 more still needed for max_tokens
            assert scheduler.kv_blocks_needed() == math.ceil(50 / 16) - 2
        if scheduler.postprocess(seqs, is_prefill):
            finished_at = step
            break
    assert finished_at == 3  # the prefill samples output 1, two decodes outputs 2 and 3
    assert seq.num_completion_tokens == 3 and manager.num_free == 10


@pytest.mark.parametrize(("options", "message"), [
    ({"prompt_tokens_median": 100}, "go together"),
    ({"prompt_tokens_median": 100, "prompt_tokens_sigma": 0}, "sigma must be above 0"),
    ({"diurnal_period_s": 100.0}, "go together"),
    ({"diurnal_period_s": 100.0, "diurnal_amplitude": 1.5}, "between 0 and 1"),
    ({"diurnal_period_s": 100.0, "diurnal_amplitude": 0.5, "rate_per_s": None}, "needs rate_per_s"),
    ({"stop_fraction_min": 0.0}, "above 0 and at most 1"),
])
def test_bad_options_say_what_to_give(options: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        spec(**options)
    with pytest.raises(ValueError, match="1 to max_tokens"):
        Sequence(0, 10, 5, stop_tokens=6)
