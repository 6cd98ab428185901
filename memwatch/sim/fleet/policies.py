"""The router's policies: which engine takes a request, from what the router last scraped of each.

Every policy sees only the engines that are up (a dead pod leaves the endpoint list, as its readiness probe
fails) and, for each, its last scrape plus the requests the router itself sent there that the scrape does
not show yet (the engine has written no sample since they reached it). A router knows what it sent; counting
it keeps a burst, or the arrivals during an engine's long prefill step, from all landing on the one engine
that looked best, and every load-aware policy counts it the same way, so what differs between them is what
their signals say.

* ``round-robin``: the next engine in turn.
* ``kv-usage``: the llm-d default's view: KV-cache usage (memwatch's ``memwatch_kv_blocks_used`` over
  ``memwatch_kv_blocks_capacity``) and the waiting queue; an engine is saturated at usage >= 0.8 or a queue of
  5 or more; the least used unsaturated engine wins, the least used of all when every one is saturated.
* ``kv-usage-queue``: ``kv-usage`` with the llm-d router's flow control: when every engine is saturated the
  request waits at the router (first come, first served) instead of joining an engine's queue, and is
  offered again at a later scrape. llm-d's flow-control guide: "Hold requests during peak saturation
  instead of committing them to a server's local queue"; its saturation detector uses the same two
  thresholds. The fair baseline for a policy that itself holds requests back.
* ``memwatch``: among engines whose signal is valid, those that can take the request now: its KV check
  (:func:`fits_kv`: the request's own tokens, once for itself and once per request waiting ahead of it,
  plus the tokens sent and not yet shown, within the tokens neither used nor promised, from
  ``memwatch_kv_free_tokens`` and the expected or committed usage: :func:`commitment`) and its activation check
  (``memwatch_max_safe_prefill_tokens`` covers its prompt, once for itself and once per request waiting
  ahead of it, plus the prompts sent and not yet shown: the engine may prefill them in the same forward).
  The lowest expected KV usage wins (plus the share the requests sent and not yet shown will take), the
  larger safe prefill breaking ties. When none can, the request waits
  at the router for a later scrape (admission control instead of preemption or an OOM); when no engine has
  a valid signal it routes as ``kv-usage`` does. A router that knows each request's size makes the check of
  ``memwatch_admissible_requests`` on that size itself; the gauge, for a few fixed shapes, serves routers
  that can only compare a series with a number.

Ties go to a draw from the run's seeded generator, so the same seed gives the same routing.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Protocol

from memwatch.errors import UsageError
from memwatch.sim.fleet.engine import FleetRequest
from memwatch.sim.fleet.scrape import Scrape

KV_SATURATED_USAGE = 0.8
"""llm-d's default saturation threshold on KV-cache usage."""
QUEUE_SATURATED = 5
"""llm-d's default saturation threshold on the waiting queue."""

KV_USED = "memwatch_kv_blocks_used"
KV_TOTAL = "memwatch_kv_blocks_capacity"
WAITING = "memwatch_requests_waiting"
VALID = "memwatch_signal_valid"
SAFE_PREFILL = "memwatch_max_safe_prefill_tokens"
COMMITTED = "memwatch_kv_committed_usage_ratio"
EXPECTED = "memwatch_kv_expected_usage_ratio"
SHARE = "memwatch_expected_output_share"
FREE_TOKENS = "memwatch_kv_free_tokens"
CAPACITY_TOKENS = "memwatch_kv_capacity_tokens"
SAMPLES = "memwatch_samples_total"
ARRIVED = "memwatch_requests_arrived_total"
READ = frozenset({KV_USED, KV_TOTAL, WAITING, VALID, SAFE_PREFILL, COMMITTED, EXPECTED, SHARE, FREE_TOKENS,
                  CAPACITY_TOKENS, SAMPLES, ARRIVED})
"""Every metric family a policy reads, and the two counts that say which requests the router sent a scrape
shows: the samples written and the requests the engine's scheduler took in."""


@dataclass
class EngineView:
    """What the router knows of one engine that is up."""

    index: int
    run_id: str
    scrape: Scrape | None = None
    sent: list[FleetRequest] = field(default_factory=list)
    """Requests the router sent here that its last scrape does not show yet."""
    sent_marks: list[float] = field(default_factory=list)
    """For each of :attr:`sent`, the engine's sample count that its first sample showing it will pass."""
    sent_arrivals: list[float | None] = field(default_factory=list)
    """For each of :attr:`sent`, the engine's count of requests taken in once it has taken this one (None: the
    engine's sidecar does not count them)."""

    def rescraped(self, scrape: Scrape) -> None:
        """Take a new scrape, keeping the requests it cannot show yet. An engine shows a request in the first
        sample it writes after its scheduler took the request in: one sent when the engine had written ``n``
        samples is in the scrape once the count passed ``n`` and, where the sidecar counts the requests taken
        in, once that count reached the request's turn. Until it has, a sample says nothing of the request (it
        may still be in an API server's or engine core's queue, over HTTP), so its mark moves up to the newest
        count. A busy engine (a long prefill) may write no sample for several scrapes; forgetting what was sent
        at each scrape sent it every arrival meanwhile."""
        count = scrape.highest(SAMPLES, run_id=self.run_id)
        arrived = scrape.highest(ARRIVED, run_id=self.run_id)
        kept = []
        if count is not None:  # a sidecar without the count cannot show them: nothing is kept past it
            for request, mark, turn in zip(self.sent, self.sent_marks, self.sent_arrivals, strict=True):
                if turn is not None and arrived is not None and arrived < turn:
                    kept.append((request, count, turn))  # not taken in yet: no sample so far shows it
                elif count <= mark:
                    kept.append((request, mark, turn))
        self.scrape = scrape
        self.sent = [request for request, _, _ in kept]
        self.sent_marks = [mark for _, mark, _ in kept]
        self.sent_arrivals = [turn for _, _, turn in kept]

    def send(self, request: FleetRequest) -> None:
        """Count ``request`` as sent here until a scrape shows it (:meth:`rescraped`): its turn among the
        requests the engine takes in comes after those already taken in and those sent before it."""
        count, arrived = self.highest(SAMPLES), self.highest(ARRIVED)
        turns = [turn for turn in self.sent_arrivals if turn is not None]
        self.sent.append(request)
        self.sent_marks.append(-1.0 if count is None else count)
        self.sent_arrivals.append(None if arrived is None else max([arrived, *turns]) + 1)

    def lowest(self, name: str, **labels: str) -> float | None:
        return None if self.scrape is None else self.scrape.lowest(name, run_id=self.run_id, **labels)

    def highest(self, name: str, **labels: str) -> float | None:
        return None if self.scrape is None else self.scrape.highest(name, run_id=self.run_id, **labels)

    def kv_usage(self) -> float | None:
        """KV blocks used over total: the fraction a router reads today."""
        used, total = self.highest(KV_USED), self.lowest(KV_TOTAL)
        return None if used is None or not total else used / total


class Policy(Protocol):
    name: str

    def choose(self, request: FleetRequest, views: list[EngineView]) -> int | None:
        """The index of the engine that takes ``request``, or None to keep it at the router for now."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self, rng: random.Random) -> None:
        self._next = 0

    def choose(self, request: FleetRequest, views: list[EngineView]) -> int | None:
        if not views:
            return None
        ordered = sorted(views, key=lambda view: view.index)
        view = next((v for v in ordered if v.index >= self._next), ordered[0])
        self._next = view.index + 1
        return view.index


class KvUsage:
    name = "kv-usage"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, request: FleetRequest, views: list[EngineView]) -> int | None:
        best = self._best(views)
        return None if best is None else best[-1]

    def _best(self, views: list[EngineView]) -> tuple[bool, float, float, float, int] | None:
        """The least used engine, unsaturated ones first: (saturated, usage, queue, tie-break, index)."""
        if not views:
            return None
        ranked = []
        for view in views:
            usage = view.kv_usage()
            queue = (view.highest(WAITING) or 0) + len(view.sent)
            usage = 0.0 if usage is None else usage
            saturated = usage >= KV_SATURATED_USAGE or queue >= QUEUE_SATURATED
            ranked.append((saturated, usage, queue, self._rng.random(), view.index))
        return min(ranked)


class KvUsageQueue(KvUsage):
    name = "kv-usage-queue"

    def choose(self, request: FleetRequest, views: list[EngineView]) -> int | None:
        best = self._best(views)
        return None if best is None or best[0] else best[-1]


class MemwatchHeadroom:
    name = "memwatch"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._fallback = KvUsage(rng)

    def choose(self, request: FleetRequest, views: list[EngineView]) -> int | None:
        valid = [view for view in views if view.lowest(VALID) == 1]
        if not valid:
            return self._fallback.choose(request, views)
        ranked = []
        for view in valid:
            if not fits_kv(view, request):
                continue
            safe = view.lowest(SAFE_PREFILL)
            ahead = (view.highest(WAITING) or 0) + 1
            if safe is not None and safe < ahead * request.prompt_tokens + sum(r.prompt_tokens for r in view.sent):
                continue
            committed, share = commitment(view)
            committed = 1.0 if committed is None else committed + _sent_share(view, share)
            ranked.append((committed, -(safe or 0.0), self._rng.random(), view.index))
        return min(ranked)[-1] if ranked else None


def commitment(view: EngineView) -> tuple[float | None, float]:
    """The engine's committed KV usage and the share of ``max_tokens`` its requests are expected to reach: the
    expected usage and share where the sidecar exports them (its finished requests support an estimate), else
    the worst case, every request to its ``max_tokens``."""
    expected, share = view.highest(EXPECTED), view.highest(SHARE)
    if expected is not None and share is not None:
        return expected, share
    return view.highest(COMMITTED), 1.0


def tokens_of(request: FleetRequest, share: float) -> float:
    """The KV tokens a request is expected to hold at its end: its prompt and that share of its outputs."""
    return request.prompt_tokens + math.ceil(share * request.output_tokens)


def cache_tokens(view: EngineView) -> float | None:
    """The engine's KV cache in tokens: ``memwatch_kv_capacity_tokens``, of the sample the committed usage and free
    tokens come from. A sidecar without it: free tokens over the free fraction of blocks, which mixes that sample
    with the stored one ``memwatch_kv_blocks_used`` comes from (an engine that just emptied reads a stale usage
    beside all its tokens free, and a cache several times its size). ``None``: it cannot be told."""
    capacity = view.lowest(CAPACITY_TOKENS)
    if capacity is not None:
        return capacity if capacity > 0 else None
    free_tokens, usage = view.lowest(FREE_TOKENS), view.kv_usage()
    if free_tokens is None or usage is None or usage >= 1.0:
        return None
    return free_tokens / (1.0 - usage)


def fits_kv(view: EngineView, request: FleetRequest) -> bool:
    """The check ``memwatch_admissible_requests`` makes, on the request's own size: its tokens, once for itself
    and once for each request waiting ahead of it (counted as its size: the gauges carry no per-request
    sizes), plus the tokens of those sent and not yet shown, fit in the tokens neither used nor promised (with
    the expected commitment and output share where exported): the cache's tokens (:func:`cache_tokens`) less the
    committed share. An engine whose gauges cannot tell is not refused; a full one admits nothing."""
    (committed, share), free_tokens = commitment(view), view.lowest(FREE_TOKENS)
    if free_tokens is None or committed is None:
        return True
    cache = cache_tokens(view)
    if cache is None:
        return view.kv_usage() is None  # no usage either: cannot tell; else the cache is full
    unpromised = cache * (1.0 - committed)
    ahead = (view.highest(WAITING) or 0) + 1
    sent = sum(tokens_of(r, share) for r in view.sent)
    return ahead * tokens_of(request, share) + sent <= unpromised


def _sent_share(view: EngineView, share: float) -> float:
    """The KV share the requests sent and not yet shown will commit: their tokens over the cache's tokens
    (:func:`cache_tokens`; 0 when that cannot be told)."""
    cache = cache_tokens(view)
    if not view.sent or cache is None:
        return 0.0
    return sum(tokens_of(r, share) for r in view.sent) / cache


POLICIES = ("round-robin", "kv-usage", "kv-usage-queue", "memwatch")
BASELINES = ("round-robin", "kv-usage", "kv-usage-queue")
"""The simple policies a memory-aware one is judged against: the best of them on each measure."""


def make_policy(name: str, rng: random.Random) -> Policy:
    """A policy by its command-line name."""
    if name == "round-robin":
        return RoundRobin(rng)
    if name == "kv-usage":
        return KvUsage(rng)
    if name == "kv-usage-queue":
        return KvUsageQueue(rng)
    if name == "memwatch":
        return MemwatchHeadroom(rng)
    raise UsageError(f"unknown router policy {name!r}; use one of {', '.join(POLICIES)}, or all to compare them")
