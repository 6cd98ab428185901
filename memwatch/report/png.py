"""``memwatch report RUN -o FILE.png``: the report's figure as one image for a ticket or a chat.

The same rows as the HTML figure (:mod:`memwatch.report.figure`), drawn by matplotlib on its
non-interactive Agg backend; matplotlib is imported here only, lazily.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from memwatch.report.figure import (
    CRASH_COLOR,
    GIB,
    PHASE_COLORS,
    SEVERITY_COLORS,
    TERM_COLORS,
    as_array,
    crash_point,
    flag_levels,
    phase_label_rows,
    seconds,
)
from memwatch.report.optional import require
from memwatch.report.run_data import STACK_TERMS, RankData, RunData

WIDTH_IN, MEMORY_IN, KV_IN, DPI = 12.0, 3.6, 1.6, 110
LABEL_PT, LABEL_ROW_PT = 7, 9
AXES_PX = WIDTH_IN * DPI * 0.8
"""The time axis's width in the image per span of data: the figure's less the y axis's labels and matplotlib's
5 % margins on either side."""
LABEL_CHAR_PX = LABEL_PT * DPI / 72 * 0.7
"""One character of a phase name, rounded up (a wide glyph is about 0.65 em)."""
LABEL_BOX = {"boxstyle": "square,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85}
"""Behind each phase name, so a grid line or shading never runs through its letters."""
FLAG_PX = 9.0
"""Room one flag marker (7 pt) takes on the time axis and between stacked markers."""
KIND_MARKERS = ("v", "D", "s", "^", "P", "X", "h", "o", "<", ">")
"""A flag kind's shape (its colour is its severity); the legend names each kind."""
LEGEND_COLUMNS, LEGEND_ROW_IN = 5, 0.2
"""The legend's columns, and the height one row of it adds to the image beyond the two that always fit."""


def _pyplot() -> Any:
    require("matplotlib", "the PNG report").use("Agg", force=True)
    return require("matplotlib.pyplot", "the PNG report")


def _values(values: list[int | None]) -> Any:
    return as_array(values, GIB)


def write_png(data: RunData, path: str | Path) -> None:
    """Draw ``data`` into ``path`` (PNG)."""
    plt = _pyplot()
    fig = draw(data)
    try:
        fig.savefig(path, dpi=DPI, format="png")
    finally:
        plt.close(fig)


def flag_markers(data: RunData) -> dict[str, str]:
    """A marker shape per flag kind of the run, so each kind has its own legend entry on every rank."""
    kinds = sorted({flag.kind for rank in data.ranks for flag in rank.flags})
    return {kind: KIND_MARKERS[i % len(KIND_MARKERS)] for i, kind in enumerate(kinds)}


def draw(data: RunData) -> Any:
    """The report's figure as a matplotlib figure (the caller closes it): one row per rank's memory and KV
    blocks, a legend that names every line, flag kind and ending, phase names in a band above the data."""
    plt = _pyplot()
    rows: list[tuple[RankData, str]] = []
    for rank in data.ranks:
        rows.append((rank, "memory"))
        if rank.has_kv:
            rows.append((rank, "kv"))
    heights = [MEMORY_IN if kind == "memory" else KV_IN for _, kind in rows] or [MEMORY_IN]
    height = sum(heights) + 0.9
    fig, axes = plt.subplots(len(heights), 1, figsize=(WIDTH_IN, height), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    try:
        markers = flag_markers(data)
        label_bands: list[tuple[Any, int]] = []
        for ax, (rank, kind) in zip(axes[:, 0], rows, strict=False):
            x = as_array([seconds(t, data.start_ns) for t in rank.points.ts_ns])
            first, last = (float(x[0]), float(x[-1])) if len(x) else (0.0, 0.0)
            if kind == "memory":
                _memory(ax, rank, x, data.start_ns, markers, (first, last))
            else:
                _kv(ax, rank, x, data.start_ns)
            label_at = phase_label_rows(rank, data.start_ns, first, last, width_px=AXES_PX, char_px=LABEL_CHAR_PX)
            for phase, label_row in zip(rank.phases, label_at, strict=True):
                ax.axvspan(seconds(phase.start_ns, data.start_ns), seconds(phase.end_ns, data.start_ns),
                           color=PHASE_COLORS.get(phase.name, "#999999"), alpha=0.08, lw=0)
                if kind == "memory":
                    ax.annotate(phase.name, (seconds(phase.start_ns, data.start_ns), 1.0),
                                xycoords=("data", "axes fraction"), xytext=(1, -1 - LABEL_ROW_PT * label_row),
                                textcoords="offset points", fontsize=LABEL_PT, va="top", color="#555555",
                                bbox=LABEL_BOX, zorder=5)
            if kind == "memory" and label_at:
                label_bands.append((ax, max(label_at) + 1))
            ax.grid(alpha=0.25)
        axes[-1, 0].set_xlabel("seconds since the run started")
        handles: dict[str, Any] = {}
        for ax in axes[:, 0]:  # every rank's entries, each name once (a flag may be raised on one rank only)
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(label, handle)
        legend_rows = -(-len(handles) // LEGEND_COLUMNS)
        height += max(legend_rows - 2, 0) * LEGEND_ROW_IN  # the rows keep their size under a longer legend
        fig.set_figheight(height)
        fig.suptitle(f"memwatch run {data.run.run_id}: {data.run.status or 'unknown'}", x=0.01, y=1 - 0.05 / height,
                     ha="left", va="top", fontsize=11)
        fig.legend(list(handles.values()), list(handles), loc="upper center", bbox_to_anchor=(0.5, 1 - 0.3 / height),
                   ncol=LEGEND_COLUMNS, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 1 - (0.35 + LEGEND_ROW_IN * legend_rows) / height))
        for ax, label_rows_used in label_bands:
            _make_room_for_labels(ax, label_rows_used)
    except BaseException:
        plt.close(fig)
        raise
    return fig


def _make_room_for_labels(ax: Any, label_rows_used: int) -> None:
    """Raise the top of ``ax``'s y range so that its phase names sit in a band above everything plotted."""
    band_px = (2 + LABEL_ROW_PT * (label_rows_used - 1) + LABEL_PT * 1.3 + 3) * DPI / 72
    axes_px = ax.get_position().height * ax.figure.get_figheight() * DPI
    low, high = ax.get_ylim()
    if axes_px > band_px:
        ax.set_yticks([tick for tick in ax.get_yticks() if low <= tick <= high])  # no scale in the band
        ax.set_ylim(low, low + (high - low) * axes_px / (axes_px - band_px))


def _memory(ax: Any, rank: RankData, x: Any, start_ns: int, markers: dict[str, str],
            span: tuple[float, float]) -> None:
    if len(x):
        ax.stackplot(x, *[_values(rank.points.stack[key]) for key, _ in STACK_TERMS],
                     labels=[label for _, label in STACK_TERMS], colors=[TERM_COLORS[key] for key, _ in STACK_TERMS],
                     alpha=0.85, lw=0)
        ax.plot(x, _values(rank.points.used), color="#222222", lw=1.0, label="driver used")
        ax.plot(x, _values(rank.points.budget), color="#2ca02c", lw=1.0, ls="--", label="budget (total × utilization)")
    if rank.total_bytes:
        ax.axhline(rank.total_bytes / GIB, color="#7f7f7f", lw=0.8, ls=":", label="GPU total")
    top = (rank.total_bytes or max((u or 0) for u in rank.points.used or [0])) / GIB
    # Vertical marks end at the data's top, not the axes', so they never cross the band of phase names.
    step_y = top * 1.1 * FLAG_PX / (MEMORY_IN * DPI * 0.75)
    for severity, flags, levels in flag_levels(rank, start_ns, *span, width_px=AXES_PX, mark_px=FLAG_PX):
        color = SEVERITY_COLORS.get(severity, "#999999")
        for flag, level in zip(flags, levels, strict=True):
            at = seconds(flag.ts_ns, start_ns)
            ax.vlines(at, 0, top, color=color, lw=0.8, ls="--", alpha=0.8)
            ax.plot([at], [top - level * step_y], ls="none", marker=markers[flag.kind], ms=7, color=color,
                    mec="white", mew=0.5, zorder=4, label=f"flag: {flag.kind} ({severity})")
    for event in rank.ooms:
        i = max(bisect.bisect_right(rank.points.ts_ns, event.ts_ns) - 1, 0)
        used = rank.points.used[i] if rank.points.used else None
        ax.vlines(seconds(event.ts_ns, start_ns), 0, top, color="#d62728", lw=1.2)
        ax.plot([seconds(event.ts_ns, start_ns)], [(used or 0) / GIB], marker="x", ms=10, mew=2, color="#d62728",
                label="out of memory", ls="none", zorder=4)
    end = crash_point(rank)
    if end is not None:
        ax.vlines(seconds(end.ts_ns, start_ns), 0, top, color=CRASH_COLOR, lw=1.2, ls="--")
        ax.plot([seconds(end.ts_ns, start_ns)], [(end.used or 0) / GIB], marker="*", ms=13, color=CRASH_COLOR,
                mec="white", mew=0.5, ls="none", zorder=4, label="crash (no OOM event)")
    ax.set_ylabel("GiB")
    ax.set_title(f"rank {rank.rank}: memory", fontsize=9, loc="left")


def _kv(ax: Any, rank: RankData, x: Any, start_ns: int) -> None:
    used, total = as_array(rank.points.kv_used), as_array(rank.points.kv_total)
    ax.fill_between(x, used, color="#55a868", alpha=0.5, lw=0)
    ax.plot(x, used, color="#55a868", lw=1.0)
    ax.plot(x, total, color="#222222", lw=1.0, ls="--")
    for event in rank.preemptions:
        ax.axvline(seconds(event.ts_ns, start_ns), color="#e69f00", lw=0.6, alpha=0.7)
    ax.set_ylabel("blocks")
    ax.set_title(f"rank {rank.rank}: KV blocks used / total, preemptions", fontsize=9, loc="left")
