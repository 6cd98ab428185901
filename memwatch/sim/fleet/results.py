"""What a fleet run reports per policy, and the table ``memwatch sim --fleet`` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from memwatch.sim.clock import NS_PER_S


@dataclass(frozen=True)
class PolicyResult:
    """One policy's outcome on one trace.

    ``completed``: requests that finished. ``ooms``: engines whose GPU ran out of memory (each such engine
    died and served nothing more). ``preemptions``: requests the engines preempted, summed. ``p50_queue_s``
    and ``p99_queue_s``: from a completed request's arrival at the router to its first scheduled step
    (waiting at the router included), nearest-rank percentiles. ``tokens_per_s``: output tokens of the
    completed requests over the time from the trace's start to the last completion. ``lost``: requests an
    engine held when it died; ``rejected``: requests the router still held when nothing could ever admit them.
    """

    policy: str
    trace: str
    engines: int
    seed: int
    requests: int
    completed: int
    ooms: int
    preemptions: int
    p50_queue_s: float | None
    p99_queue_s: float | None
    tokens_per_s: float
    lost: int
    rejected: int
    simulated_s: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least ``q`` % of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summarize(policy: str, trace: str, engines: int, seed: int, requests: int, queue_ns: list[int],
              output_tokens: int, last_finish_ns: int, ooms: int, preemptions: int, lost: int, rejected: int,
              simulated_ns: int) -> PolicyResult:
    """The result from the raw counts (times in virtual nanoseconds from the trace's start)."""
    queue_s = [ns / NS_PER_S for ns in queue_ns]
    p50, p99 = percentile(queue_s, 50), percentile(queue_s, 99)
    return PolicyResult(
        policy=policy, trace=trace, engines=engines, seed=seed, requests=requests, completed=len(queue_ns),
        ooms=ooms, preemptions=preemptions,
        p50_queue_s=None if p50 is None else round(p50, 4), p99_queue_s=None if p99 is None else round(p99, 4),
        tokens_per_s=round(output_tokens * NS_PER_S / last_finish_ns, 2) if last_finish_ns > 0 else 0.0,
        lost=lost, rejected=rejected, simulated_s=round(simulated_ns / NS_PER_S, 3),
    )


def render_table(results: list[PolicyResult]) -> str:
    """One line per policy, the columns of the JSON."""
    if not results:
        return "no policy ran"
    first = results[0]
    head = (f"trace {first.trace}: {first.requests:,} requests, {first.engines} engines, seed {first.seed}\n"
            f"{'policy':<12} {'completed':>9} {'ooms':>4} {'preemptions':>11} {'p50 queue s':>11} "
            f"{'p99 queue s':>11} {'tokens/s':>9} {'lost':>4} {'rejected':>8}")

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = [f"{r.policy:<12} {r.completed:>9,} {r.ooms:>4} {r.preemptions:>11,} {cell(r.p50_queue_s):>11} "
            f"{cell(r.p99_queue_s):>11} {r.tokens_per_s:>9,.1f} {r.lost:>4} {r.rejected:>8}" for r in results]
    return "\n".join([head, *rows])
