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


def versus_best(results: list[PolicyResult], baselines: tuple[str, ...]) -> dict[str, dict[str, float | None]]:
    """Each policy's tokens/s over the best baseline's (the highest) and p99 queue time over the best baseline's
    (the lowest), the baselines being those of ``baselines`` that ran; ``None`` where a ratio cannot be formed
    (no baseline ran, or the best one's figure is 0 or missing)."""
    ran = [r for r in results if r.policy in baselines]
    best_rate = max((r.tokens_per_s for r in ran), default=0.0)
    best_p99 = min((r.p99_queue_s for r in ran if r.p99_queue_s is not None), default=None)
    ratios: dict[str, dict[str, float | None]] = {}
    for r in results:
        rate = round(r.tokens_per_s / best_rate, 3) if best_rate > 0 else None
        p99 = (round(r.p99_queue_s / best_p99, 3) if best_p99 is not None and best_p99 > 0
               and r.p99_queue_s is not None else None)
        ratios[r.policy] = {"tokens_per_s_ratio": rate, "p99_queue_ratio": p99}
    return ratios


def render_table(results: list[PolicyResult], baselines: tuple[str, ...] = ()) -> str:
    """One line per policy, the columns of the JSON; with ``baselines`` that ran, each policy's tokens/s and p99
    queue time over the best baseline's (:func:`versus_best`)."""
    if not results:
        return "no policy ran"
    first = results[0]
    ratios = versus_best(results, baselines) if any(r.policy in baselines for r in results) else None
    head = (f"trace {first.trace}: {first.requests:,} request{'s' * (first.requests != 1)}, "
            f"{first.engines} engine{'s' * (first.engines != 1)}, seed {first.seed}\n"
            f"{'policy':<14} {'completed':>9} {'ooms':>4} {'preemptions':>11} {'p50 queue s':>11} "
            f"{'p99 queue s':>11} {'tokens/s':>9} {'lost':>4} {'rejected':>8}")
    if ratios is not None:
        head += f" {'tokens/s ÷ best':>15} {'p99 ÷ best':>10}"

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = []
    for r in results:
        row = (f"{r.policy:<14} {r.completed:>9,} {r.ooms:>4} {r.preemptions:>11,} {cell(r.p50_queue_s):>11} "
               f"{cell(r.p99_queue_s):>11} {r.tokens_per_s:>9,.1f} {r.lost:>4} {r.rejected:>8}")
        if ratios is not None:
            ratio = ratios[r.policy]
            row += f" {cell(ratio['tokens_per_s_ratio']):>15} {cell(ratio['p99_queue_ratio']):>10}"
        rows.append(row)
    footer = [f"best baseline: the best of {', '.join(b for b in baselines if any(r.policy == b for r in results))} "
              "on each measure (highest tokens/s, lowest p99 queue)"] if ratios is not None else []
    return "\n".join([head, *rows, *footer])
