"""The requests a simulated engine serves: fixed groups and seeded random ones, each with an arrival time."""

from __future__ import annotations

import random
from dataclasses import dataclass

from memwatch.errors import UsageError
from memwatch.sim.clock import NS_PER_S


@dataclass(frozen=True)
class Request:
    request_id: int
    prompt_tokens: int
    output_tokens: int
    arrival_ns: int
    """Virtual nanoseconds after serving starts."""


@dataclass(frozen=True)
class RequestGroup:
    """``count`` identical requests, the first at ``arrival_s``, then one every ``interval_s``."""

    prompt_tokens: int
    output_tokens: int
    count: int = 1
    arrival_s: float = 0.0
    interval_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.count < 1:
            raise UsageError("a request group needs prompt_tokens, output_tokens and count of at least 1")
        if self.arrival_s < 0 or self.interval_s < 0:
            raise UsageError("a request group's arrival_s and interval_s cannot be negative")

    @property
    def max_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class RandomRequests:
    """``count`` requests with uniformly drawn lengths and Poisson arrivals (all at 0 without a rate).

    With ``burst_max`` above 1 the traffic is bursty (a compound Poisson stream): each arrival of the
    stream brings a burst of 1 to ``burst_max`` requests (uniformly drawn) at the same moment, as when
    a client retries together or a batch job submits at once. The mean load is ``rate_per_s`` times the
    mean burst, ``(1 + burst_max) / 2``.
    """

    count: int
    prompt_tokens_min: int
    prompt_tokens_max: int
    output_tokens_min: int
    output_tokens_max: int
    rate_per_s: float | None = None
    burst_max: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 1 <= self.prompt_tokens_min <= self.prompt_tokens_max:
            raise UsageError("random requests need count >= 1 and 1 <= prompt_tokens_min <= prompt_tokens_max")
        if not 1 <= self.output_tokens_min <= self.output_tokens_max:
            raise UsageError("random requests need 1 <= output_tokens_min <= output_tokens_max")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise UsageError("random requests: rate_per_s must be positive (or left out for one burst)")
        if self.burst_max < 1:
            raise UsageError("random requests: burst_max must be at least 1 (1: no bursts)")

    @property
    def max_tokens(self) -> int:
        return self.prompt_tokens_max + self.output_tokens_max


@dataclass(frozen=True)
class Workload:
    groups: tuple[RequestGroup, ...] = ()
    random: RandomRequests | None = None

    def __post_init__(self) -> None:
        if not self.groups and self.random is None:
            raise UsageError("a workload needs at least one [[workload.requests]] group or [workload.random]")

    @property
    def longest_request(self) -> int:
        """The most tokens (prompt + output) any request of this workload can reach."""
        lengths = [group.max_tokens for group in self.groups]
        if self.random is not None:
            lengths.append(self.random.max_tokens)
        return max(lengths)

    def generate(self, seed: int) -> list[Request]:
        """Every request, ordered by arrival (ties keep declaration order); same seed, same list."""
        drafts: list[tuple[int, int, int]] = []
        for group in self.groups:
            for i in range(group.count):
                arrival = round((group.arrival_s + i * group.interval_s) * NS_PER_S)
                drafts.append((arrival, group.prompt_tokens, group.output_tokens))
        if self.random is not None:
            drafts.extend(_random_drafts(self.random, random.Random(seed)))
        drafts.sort(key=lambda draft: draft[0])
        return [Request(i, prompt, output, arrival) for i, (arrival, prompt, output) in enumerate(drafts)]


def _random_drafts(spec: RandomRequests, rng: random.Random) -> list[tuple[int, int, int]]:
    """Draws in a fixed order (gap, then the burst's size when bursty, then each request's lengths), so a
    scenario without bursts draws exactly what it drew before bursts existed."""
    drafts: list[tuple[int, int, int]] = []
    clock_s, left_in_burst = 0.0, 0
    for _ in range(spec.count):
        if left_in_burst == 0:
            if spec.rate_per_s is not None:
                clock_s += rng.expovariate(spec.rate_per_s)
            left_in_burst = rng.randint(1, spec.burst_max) if spec.burst_max > 1 else 1
        left_in_burst -= 1
        prompt = rng.randint(spec.prompt_tokens_min, spec.prompt_tokens_max)
        output = rng.randint(spec.output_tokens_min, spec.output_tokens_max)
        drafts.append((round(clock_s * NS_PER_S), prompt, output))
    return drafts
