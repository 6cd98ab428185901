"""A healthy rank's tightest serving moment, as ``explain`` says it: the margin and the terms it adds up from.

The parenthesis is the ledger's own sum (:mod:`memwatch.ledger`): ``free + reclaimable − need``, the need being
the activation reserve or the largest step rise once a forward needed more; without allocator signals
``free − (need − cache slack)`` while the slack is below the need.
"""

from __future__ import annotations

from dataclasses import dataclass

from memwatch.detectors.summary import ServingPoint
from memwatch.detectors.wording import format_bytes, format_count


@dataclass(frozen=True)
class Tightest:
    rank: int
    step: int
    oom_margin_bytes: int
    driver_free_bytes: int | None
    cache_slack_bytes: int | None
    activation_reserve_bytes: int | None
    headroom_bytes: int | None
    sentence: str
    reclaimable_cache_bytes: int | None = None
    """Whole free cached segments (counted as free by the margin); ``None`` without allocator signals."""
    at_serving_start: bool = False
    """The smallest margin was already the first serving sample's: it never fell while serving."""
    need_bytes: int | None = None
    """What the margin took for the next worst-case forward (:func:`forward_need`): the activation reserve, or
    the largest step rise when that was larger; ``oom_margin_bytes = free + reclaimable − need_bytes``."""
    ts_ns: int | None = None
    """When the tightest sample was taken (a step may hold several samples)."""


def tightest_report(rank: int, tight: ServingPoint | None, first: ServingPoint | None) -> Tightest | None:
    """A run that did not run out: the rank's tightest serving moment, with the terms its margin adds up from."""
    if tight is None or tight.oom_margin_bytes is None:
        return None
    margin = tight.oom_margin_bytes
    assert margin is not None
    # The first serving sample is taken before any request ran: when it holds the smallest margin, the
    # margin never fell while serving, which is what is true to say.
    at_start = first is not None and (first.step, first.ts_ns) == (tight.step, tight.ts_ns)
    when = ("'s OOM margin never fell below where it stood when serving began" if at_start
            else f"'s tightest serving moment was step {format_count(tight.step)}")
    need = forward_need(tight)
    sentence = (f"rank {rank}{when}: {format_bytes(margin)} would have been left after a worst-case forward "
                f"({_margin_terms(tight, need)}).")
    return Tightest(rank, tight.step, margin, tight.driver_free_bytes, tight.cache_slack_bytes,
                    tight.activation_reserve_bytes, tight.headroom_bytes, sentence, tight.reclaimable_cache_bytes,
                    at_start, need, tight.ts_ns)


def forward_need(point: ServingPoint) -> int | None:
    """What the ledger's margin took for the next worst-case forward at ``point``: the activation reserve, or the
    largest rise a serving step has shown when that was larger (:mod:`memwatch.ledger`). Read back from the
    margin, ``free + reclaimable − need`` (without allocator signals ``free − (need − cache slack)`` while the
    slack is below the need); ``None`` when the margin does not say it (the slack covered the need)."""
    free, margin, reclaimable = point.driver_free_bytes, point.oom_margin_bytes, point.reclaimable_cache_bytes
    if free is None or margin is None:
        return None
    if reclaimable is not None:
        return free + reclaimable - margin
    slack = point.cache_slack_bytes
    if slack is None or margin == free:
        return None
    return free + slack - margin


def _margin_terms(tight: ServingPoint, need: int | None) -> str:
    """The parenthesis after a tightest margin: the terms that add up to it, exactly as the ledger adds them."""
    free, slack, reserve = tight.driver_free_bytes, tight.cache_slack_bytes, tight.activation_reserve_bytes
    if need is not None and reserve is not None and need > reserve:
        what = (f"the {format_bytes(need)} largest step rise seen, above the {format_bytes(reserve)} activation "
                "reserve warmup measured")
    else:
        what = f"the {format_bytes(reserve if need is None else need)} activation reserve"
    if tight.reclaimable_cache_bytes is not None:
        return (f"{format_bytes(free)} free + {format_bytes(tight.reclaimable_cache_bytes)} reclaimable of the "
                f"{format_bytes(slack)} cache slack − {what}")
    if need is None:
        return f"{format_bytes(free)} free; the {format_bytes(slack)} cache slack holds {what}"
    return f"{format_bytes(free)} free + {format_bytes(slack)} cache slack − {what}"
