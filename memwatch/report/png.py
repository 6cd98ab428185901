"""``memwatch report RUN -o FILE.png``: the report's figure as one image for a ticket or a chat.

The same rows as the HTML figure (:mod:`memwatch.report.figure`), drawn by matplotlib on its
non-interactive Agg backend; matplotlib is imported here only, lazily.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from memwatch.optional import require
from memwatch.report.figure import (
    GIB,
    PHASE_COLORS,
    SEVERITY_COLORS,
    TERM_COLORS,
    as_array,
    phase_label_rows,
    seconds,
)
from memwatch.report.run_data import STACK_TERMS, RankData, RunData

WIDTH_IN, MEMORY_IN, KV_IN, DPI = 12.0, 3.6, 1.6, 110
LABEL_PT, LABEL_ROW_PT = 7, 9
AXES_PX = WIDTH_IN * DPI * 0.8
"""The time axis's width in the image per span of data: the figure's less the y axis's labels and matplotlib's
5 % margins on either side."""
LABEL_CHAR_PX = LABEL_PT * DPI / 72 * 0.7
"""One character of a phase name, rounded up (a wide glyph is about 0.65 em)."""


def _pyplot() -> Any:
    require("matplotlib", "the PNG report").use("Agg", force=True)
    return require("matplotlib.pyplot", "the PNG report")


def _values(values: list[int | None]) -> Any:
    return as_array(values, GIB)


def write_png(data: RunData, path: str | Path) -> None:
    """Draw ``data`` into ``path`` (PNG)."""
    plt = _pyplot()
    rows: list[tuple[RankData, str]] = []
    for rank in data.ranks:
        rows.append((rank, "memory"))
        if rank.has_kv:
            rows.append((rank, "kv"))
    heights = [MEMORY_IN if kind == "memory" else KV_IN for _, kind in rows] or [MEMORY_IN]
    fig, axes = plt.subplots(len(heights), 1, figsize=(WIDTH_IN, sum(heights) + 0.9), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    try:
        for ax, (rank, kind) in zip(axes[:, 0], rows, strict=False):
            x = as_array([seconds(t, data.start_ns) for t in rank.points.ts_ns])
            if kind == "memory":
                _memory(ax, rank, x, data.start_ns)
            else:
                _kv(ax, rank, x, data.start_ns)
            label_at = phase_label_rows(rank, data.start_ns, float(x[0]) if len(x) else 0.0,
                                        float(x[-1]) if len(x) else 0.0, width_px=AXES_PX, char_px=LABEL_CHAR_PX)
            for phase, label_row in zip(rank.phases, label_at, strict=True):
                ax.axvspan(seconds(phase.start_ns, data.start_ns), seconds(phase.end_ns, data.start_ns),
                           color=PHASE_COLORS.get(phase.name, "#999999"), alpha=0.08, lw=0)
                if kind == "memory":
                    ax.annotate(phase.name, (seconds(phase.start_ns, data.start_ns), 1.0),
                                xycoords=("data", "axes fraction"), xytext=(1, -1 - LABEL_ROW_PT * label_row),
                                textcoords="offset points", fontsize=LABEL_PT, va="top", color="#555555")
            ax.grid(alpha=0.25)
        axes[-1, 0].set_xlabel("seconds since the run started")
        height = sum(heights) + 0.9
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.suptitle(f"memwatch run {data.run.run_id}: {data.run.status or 'unknown'}", x=0.01, y=1 - 0.05 / height,
                     ha="left", va="top", fontsize=11)
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.3 / height), ncol=5, fontsize=8,
                   frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.8 / height))
        fig.savefig(path, dpi=DPI, format="png")
    finally:
        plt.close(fig)


def _memory(ax: Any, rank: RankData, x: Any, start_ns: int) -> None:
    if len(x):
        ax.stackplot(x, *[_values(rank.points.stack[key]) for key, _ in STACK_TERMS],
                     labels=[label for _, label in STACK_TERMS], colors=[TERM_COLORS[key] for key, _ in STACK_TERMS],
                     alpha=0.85, lw=0)
        ax.plot(x, _values(rank.points.used), color="#222222", lw=1.0, label="driver used")
        ax.plot(x, _values(rank.points.budget), color="#2ca02c", lw=1.0, ls="--", label="budget (total × utilization)")
    if rank.total_bytes:
        ax.axhline(rank.total_bytes / GIB, color="#7f7f7f", lw=0.8, ls=":", label="GPU total")
    for flag in rank.flags:
        ax.axvline(seconds(flag.ts_ns, start_ns), color=SEVERITY_COLORS.get(flag.severity, "#999999"), lw=0.8, ls="--")
    for event in rank.ooms:
        i = max(bisect.bisect_right(rank.points.ts_ns, event.ts_ns) - 1, 0)
        used = rank.points.used[i] if rank.points.used else None
        ax.axvline(seconds(event.ts_ns, start_ns), color="#d62728", lw=1.2)
        ax.plot([seconds(event.ts_ns, start_ns)], [(used or 0) / GIB], marker="x", ms=10, mew=2, color="#d62728",
                label="out of memory")
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
