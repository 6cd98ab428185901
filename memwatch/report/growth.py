"""Before an out-of-memory: which ledger term grew (in numbers; :mod:`.causes` words it), and how the last
window changed.

Which term grew is judged on serving samples against the first one. Cache slack is allowed the
largest activation seen (the allocator keeps what the biggest forward freed); the other terms are
allowed nothing. A term counts from :data:`MIN_GROWTH_BYTES`; its growth starts at the last sample
that was still within :data:`ONSET_TOLERANCE_BYTES` of that allowance.
"""

from __future__ import annotations

from dataclasses import dataclass

from memwatch.detectors.wording import format_bytes, format_count, format_duration_ns
from memwatch.records import Event
from memwatch.report.points import Points
from memwatch.store.run_figures import end_margin

MiB = 1 << 20
WINDOW_STEPS = 100
"""How far back the "last window before the OOM" reaches."""
MIN_GROWTH_BYTES = 64 * MiB
ONSET_TOLERANCE_BYTES = 1 * MiB
JUMP_FRACTION = 0.9
"""A growth that reached this share of its total within :data:`JUMP_STEPS` steps is a jump, not a slope."""
JUMP_STEPS = 10

TERMS: tuple[tuple[str, str], ...] = (
    ("non_torch_bytes", "non-PyTorch memory"),
    ("cache_slack_bytes", "the allocator's cache slack (reserved but unallocated)"),
    ("allocated_bytes", "PyTorch-allocated memory"),
)


@dataclass(frozen=True)
class TermGrowth:
    term: str
    label: str
    from_bytes: int
    to_bytes: int
    growth_bytes: int
    since_step: int
    steps: int
    """From ``since_step`` to the out-of-memory."""
    seconds: float
    jump: bool
    """Most of it came within a few steps (another process, one large allocation) rather than steadily."""


@dataclass(frozen=True)
class WindowChange:
    from_step: int
    to_step: int
    seconds: float
    start: dict[str, int | None]
    end: dict[str, int | None]


def term_growth(points: Points, largest_activation: int, oom: Event) -> TermGrowth | None:
    """The term that grew most beyond its allowance, or ``None`` when none grew by :data:`MIN_GROWTH_BYTES`."""
    grown = term_growths(points, largest_activation, oom)
    return grown[0] if grown else None


def term_growths(points: Points, largest_activation: int, oom: Event) -> list[TermGrowth]:
    """Every term that grew by :data:`MIN_GROWTH_BYTES` beyond its allowance, most beyond it first."""
    first, last = points.first(), points.last()
    assert first is not None and last is not None
    found: list[tuple[int, TermGrowth]] = []
    for term, label in TERMS:
        start, end = getattr(first, term), getattr(last, term)
        if start is None or end is None:
            continue
        allowed = start + (largest_activation if term == "cache_slack_bytes" else 0)
        excess = end - allowed
        if excess < MIN_GROWTH_BYTES:
            continue
        onset = points.last_at_most(term, allowed + ONSET_TOLERANCE_BYTES) or first
        from_bytes = getattr(onset, term)
        grown = end - from_bytes
        reached = points.first_reaching(term, onset.step, from_bytes + JUMP_FRACTION * grown) or last
        found.append((excess, TermGrowth(term, label, from_bytes, end, grown, onset.step, oom.step - onset.step,
                                         (oom.ts_ns - onset.ts_ns) / 1e9, reached.step - onset.step <= JUMP_STEPS)))
    # Stable on ties: the earlier term in TERMS first, as a strict ``>`` over them would choose.
    return [growth for _, growth in sorted(found, key=lambda item: -item[0])]


@dataclass(frozen=True)
class OutsideSplit:
    """Non-PyTorch growth told apart: another process's jump and a steady leak beside it."""

    jump_bytes: int
    """The other process's bytes: the flagged rise less what the leak added over the same steps."""
    jump_step: int
    """The first sample that shows the jump."""
    leak: TermGrowth | None
    """The growth besides the jump, when it reaches :data:`MIN_GROWTH_BYTES`."""


def split_outside(growth: TermGrowth, points: Points, oom: Event, jump_bytes: int, from_step: int,
                  flag_step: int) -> OutsideSplit | None:
    """Split the non-PyTorch ``growth`` into the jump an ``external_process`` flag measured (``jump_bytes`` from
    ``from_step`` to ``flag_step``) and the steady growth beside it; ``None`` when nothing but the jump grew.

    The flag's rise spans a few steps, over which a leak also grew: its rate before the jump (from the growth's
    onset to ``from_step``) is taken out of the rise. A leak that began with or after the jump is timed from the
    last sample still level with where the jump settled."""
    before = points.first_from_step(from_step)
    if before is None or before.non_torch_bytes is None or growth.term != "non_torch_bytes":
        return None
    leaked_before = before.non_torch_bytes - growth.from_bytes
    span = before.step - growth.since_step
    rate = leaked_before / span if span > 0 else 0.0
    jump = max(0, min(growth.growth_bytes, round(jump_bytes - rate * (flag_step - from_step))))
    rest = growth.growth_bytes - jump
    if rest < MIN_GROWTH_BYTES:
        return None
    reached = points.first_reaching("non_torch_bytes", from_step, before.non_torch_bytes + jump / 2)
    jump_step = from_step if reached is None else reached.step
    if span > JUMP_STEPS and leaked_before > ONSET_TOLERANCE_BYTES:
        since, from_bytes, seconds = growth.since_step, growth.from_bytes, growth.seconds
    else:
        settled = points.first_from_step(flag_step)
        if settled is None or settled.non_torch_bytes is None:
            return None
        onset = points.last_at_most("non_torch_bytes", settled.non_torch_bytes + ONSET_TOLERANCE_BYTES) or settled
        if onset.non_torch_bytes is None:
            return None
        since, from_bytes, seconds = onset.step, onset.non_torch_bytes, (oom.ts_ns - onset.ts_ns) / 1e9
    leak = TermGrowth(growth.term, growth.label, from_bytes, growth.to_bytes, rest, since, oom.step - since,
                      seconds, jump=False)
    return OutsideSplit(jump, jump_step, leak)


def last_window(points: Points, oom: Event, ran_out: bool = True) -> WindowChange | None:
    """The last :data:`WINDOW_STEPS` steps before ``oom``; ``ran_out``: whether the rank ran out of memory there (an
    out-of-memory, or a crash that left its device nearly full), so that its margin at the end is at most 0."""
    start, end = points.first_from_step(oom.step - WINDOW_STEPS), points.last()
    if start is None or end is None or start.step == end.step:
        return None  # a window of one step has no change to tell
    keys = ("driver_free_bytes", "non_torch_bytes", "cache_slack_bytes", "allocated_bytes", "oom_margin_bytes")
    last = {key: getattr(end, key) for key in keys}
    # The window ends where memory ran out: its margin is the run's end margin (at most 0), one number with check's.
    last["oom_margin_bytes"] = end_margin(last["oom_margin_bytes"], ran_out=ran_out)
    return WindowChange(start.step, end.step, (end.ts_ns - start.ts_ns) / 1e9,
                        {key: getattr(start, key) for key in keys}, last)


def window_sentence(window: WindowChange) -> str:
    def change(key: str) -> str:
        start, end = window.start[key], window.end[key]
        if start is None or end is None:
            return "-"
        return f"{'+' if end >= start else '-'}{format_bytes(abs(end - start))}"

    return (f"From step {format_count(window.from_step)} to step {format_count(window.to_step)} "
            f"({format_duration_ns(round(window.seconds * 1e9))}), free memory went from "
            f"{format_bytes(window.start['driver_free_bytes'])} to {format_bytes(window.end['driver_free_bytes'])}; "
            f"non-PyTorch {change('non_torch_bytes')}, cache slack {change('cache_slack_bytes')}, "
            f"allocated {change('allocated_bytes')}.")


def capital(text: str) -> str:
    return text[:1].upper() + text[1:]
