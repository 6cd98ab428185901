"""Where the report writes phase names: short phases side by side get their names in staggered rows.

A name is written from its phase's start to the right; the next phase may start before that text ends
(``kv_alloc`` lasts no time at all, ``cudagraph`` a fraction of a second), and the names would print on
top of each other. A name that starts clear of every name before it goes in the top row; one that does
not goes in the next free row below the name before it, so the names of a burst of short phases read down
a staircase in the order the phases ran. Past :data:`MAX_ROWS` rows the staircase wraps to the top.

The HTML page is responsive, so the axis's width in pixels is not known when the figure is built: the
rows are planned for an axis of :data:`PLAN_WIDTH_PX`, a window about 1,030 px wide with the legend beside
the rows. A wider window or a zoom only moves the names further apart.
"""

from __future__ import annotations

from collections.abc import Sequence

PLAN_WIDTH_PX = 580.0
"""The time axis's width the rows are planned for (the page's width less its margins and the legend)."""
CHAR_PX = 7.0
"""Width of one character of a 10 px label, rounded up: the wide glyphs (w, m) of a sans-serif font."""
GAP_PX = 6.0
"""Space kept after a name before the next one in the same row."""
MAX_ROWS = 6
"""How far down into the plot names may go."""


def label_rows(labels: Sequence[tuple[float, str]], start: float, end: float, *, width_px: float = PLAN_WIDTH_PX,
               char_px: float = CHAR_PX) -> list[int]:
    """For each ``(x, name)`` in order of ``x`` on an axis from ``start`` to ``end``: its row, 0 the top."""
    scale = width_px / (end - start) if end > start else 0.0
    row_ends = [float("-inf")] * MAX_ROWS
    rows: list[int] = []
    for x, name in labels:
        left = (x - start) * scale
        if all(row_end <= left for row_end in row_ends):
            row = 0
        else:
            below = rows[-1] + 1
            order = [*range(below, MAX_ROWS), *range(below)]
            # the first free row down the staircase; when every row is taken, the one freed soonest
            row = next((i for i in order if row_ends[i] <= left), min(order, key=lambda i: row_ends[i]))
        row_ends[row] = left + len(name) * char_px + GAP_PX
        rows.append(row)
    return rows


MARK_PX = 13.0
"""Room one flag marker takes on the time axis (an 11 px triangle and a little air)."""


def mark_levels(xs: Sequence[float], start: float, end: float, *, width_px: float = PLAN_WIDTH_PX,
                mark_px: float = MARK_PX) -> list[int]:
    """For each marker at ``x`` (in order of ``x``): its level, 0 the top, so that no two overlap.

    Flags raised at one step (a warning and a critical at the same sample) or a few steps apart would
    draw on one spot and hide each other: each takes the highest level that no marker within ``mark_px``
    before it holds, so a burst reads as a short column under its first flag.
    """
    scale = width_px / (end - start) if end > start else 0.0
    level_ends: list[float] = []
    levels: list[int] = []
    for x in xs:
        left = (x - start) * scale
        level = next((i for i, taken in enumerate(level_ends) if taken <= left), len(level_ends))
        if level == len(level_ends):
            level_ends.append(0.0)
        level_ends[level] = left + mark_px
        levels.append(level)
    return levels
