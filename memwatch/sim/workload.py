"""The requests a simulated engine serves: fixed groups and seeded random ones, each with an arrival time."""

from __future__ import annotations

import math
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
    stop_tokens: int | None = None
    """The outputs it generates before its end of sequence, at most ``output_tokens`` (its ``max_tokens``);
    ``None``: all of them. An engine (and a router) knows only ``max_tokens``; the stop shows when it comes."""

    @property
    def generated_tokens(self) -> int:
        return self.output_tokens if self.stop_tokens is None else self.stop_tokens


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

    Optional, each left out by default (and then drawing nothing, so a scenario without it draws what it
    always drew):

    * ``prompt_tokens_median`` and ``prompt_tokens_sigma``: prompt lengths drawn from a lognormal with that
      median and shape instead of uniformly, clipped to the min and max: the heavy tail of real prompts.
    * ``diurnal_period_s`` and ``diurnal_amplitude`` (0 to 1): the arrival rate swings as
      ``rate_per_s × (1 − amplitude × cos(2π t / period))``, from its trough at the start to its peak at half
      the period: a daily ramp into overload (arrivals thinned from a Poisson stream at the peak rate).
    * ``stop_fraction_min`` (0 to 1): each request stops at its end of sequence after a uniformly drawn
      number of outputs between that fraction of its ``max_tokens`` and all of them; ``max_tokens`` is what
      the engine and a router see.
    """

    count: int
    prompt_tokens_min: int
    prompt_tokens_max: int
    output_tokens_min: int
    output_tokens_max: int
    rate_per_s: float | None = None
    burst_max: int = 1
    prompt_tokens_median: int | None = None
    prompt_tokens_sigma: float | None = None
    diurnal_period_s: float | None = None
    diurnal_amplitude: float | None = None
    stop_fraction_min: float | None = None

    def __post_init__(self) -> None:
        self._check_optional()
        if self.count < 1 or not 1 <= self.prompt_tokens_min <= self.prompt_tokens_max:
            raise UsageError("random requests need count >= 1 and 1 <= prompt_tokens_min <= prompt_tokens_max")
        if not 1 <= self.output_tokens_min <= self.output_tokens_max:
            raise UsageError("random requests need 1 <= output_tokens_min <= output_tokens_max")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise UsageError("random requests: rate_per_s must be positive (or left out for one burst)")
        if self.burst_max < 1:
            raise UsageError("random requests: burst_max must be at least 1 (1: no bursts)")

    def _check_optional(self) -> None:
        if (self.prompt_tokens_median is None) != (self.prompt_tokens_sigma is None):
            raise UsageError("random requests: prompt_tokens_median and prompt_tokens_sigma go together")
        if self.prompt_tokens_sigma is not None and not (self.prompt_tokens_median or 0) >= 1:
            raise UsageError("random requests: prompt_tokens_median must be at least 1")
        if self.prompt_tokens_sigma is not None and not 0 < self.prompt_tokens_sigma <= 4:
            raise UsageError("random requests: prompt_tokens_sigma must be above 0 and at most 4")
        if (self.diurnal_period_s is None) != (self.diurnal_amplitude is None):
            raise UsageError("random requests: diurnal_period_s and diurnal_amplitude go together")
        if self.diurnal_period_s is not None and (self.rate_per_s is None or not self.diurnal_period_s > 0):
            raise UsageError("random requests: a diurnal profile needs rate_per_s and diurnal_period_s above 0")
        if self.diurnal_amplitude is not None and not 0 <= self.diurnal_amplitude <= 1:
            raise UsageError("random requests: diurnal_amplitude must be between 0 and 1")
        if self.stop_fraction_min is not None and not 0 < self.stop_fraction_min <= 1:
            raise UsageError("random requests: stop_fraction_min must be above 0 and at most 1")

    @property
    def max_tokens(self) -> int:
        return self.prompt_tokens_max + self.output_tokens_max

    def prompt(self, rng: random.Random) -> int:
        if self.prompt_tokens_median is None or self.prompt_tokens_sigma is None:
            return rng.randint(self.prompt_tokens_min, self.prompt_tokens_max)
        drawn = round(rng.lognormvariate(math.log(self.prompt_tokens_median), self.prompt_tokens_sigma))
        return min(max(drawn, self.prompt_tokens_min), self.prompt_tokens_max)

    def next_arrival(self, clock_s: float, rng: random.Random) -> float:
        """The stream's next arrival after ``clock_s`` (Poisson; thinned to the diurnal profile when given)."""
        assert self.rate_per_s is not None
        if self.diurnal_period_s is None or self.diurnal_amplitude is None:
            return clock_s + rng.expovariate(self.rate_per_s)
        peak = self.rate_per_s * (1 + self.diurnal_amplitude)
        while True:
            clock_s += rng.expovariate(peak)
            phase = 2 * math.pi * clock_s / self.diurnal_period_s
            rate = self.rate_per_s * (1 - self.diurnal_amplitude * math.cos(phase))
            if rng.random() * peak <= rate:
                return clock_s

    def stop(self, output: int, rng: random.Random) -> int | None:
        if self.stop_fraction_min is None:
            return None
        return rng.randint(max(1, math.ceil(self.stop_fraction_min * output)), output)


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
        drafts: list[tuple[int, int, int, int | None]] = []
        for group in self.groups:
            for i in range(group.count):
                arrival = round((group.arrival_s + i * group.interval_s) * NS_PER_S)
                drafts.append((arrival, group.prompt_tokens, group.output_tokens, None))
        if self.random is not None:
            drafts.extend(_random_drafts(self.random, random.Random(seed)))
        drafts.sort(key=lambda draft: draft[0])
        return [Request(i, prompt, output, arrival, stop) for i, (arrival, prompt, output, stop) in enumerate(drafts)]


def _random_drafts(spec: RandomRequests, rng: random.Random) -> list[tuple[int, int, int, int | None]]:
    """Draws in a fixed order (gap, then the burst's size when bursty, then each request's lengths and its
    stop), so a scenario without bursts or the optional draws draws exactly what it drew before they existed."""
    drafts: list[tuple[int, int, int, int | None]] = []
    clock_s, left_in_burst = 0.0, 0
    for _ in range(spec.count):
        if left_in_burst == 0:
            if spec.rate_per_s is not None:
                clock_s = spec.next_arrival(clock_s, rng)
            left_in_burst = rng.randint(1, spec.burst_max) if spec.burst_max > 1 else 1
        left_in_burst -= 1
        prompt = spec.prompt(rng)
        output = rng.randint(spec.output_tokens_min, spec.output_tokens_max)
        drafts.append((round(clock_s * NS_PER_S), prompt, output, spec.stop(output, rng)))
    return drafts
