"""The report's interactive figure (plotly): per rank, the ledger stacked under the driver's reading,
and KV blocks with preemptions; phases shaded, flags, out-of-memory moments and crashes marked.

plotly is imported here only, lazily, by ``memwatch report``: the sidecar and the engine plugin never
load it. Values are drawn in GiB against seconds since the run started; hovering shows bytes as GiB
and the step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from memwatch.flags import SEVERITIES, Flag
from memwatch.report.labels import MARK_PX, label_rows, mark_levels
from memwatch.report.optional import require
from memwatch.report.run_data import STACK_TERMS, RankData, RunData

GIB = float(1 << 30)
TERM_COLORS = {
    "weights": "#4c72b0", "torch_other": "#8172b3", "kv": "#55a868", "activations": "#dd8452",
    "cache_slack": "#ccb974", "non_torch": "#c44e52",
}
PHASE_COLORS = {"load": "#4c72b0", "warmup": "#dd8452", "kv_alloc": "#55a868", "cudagraph": "#8172b3",
                "serve": "#937860"}
SEVERITY_COLORS = {"info": "#4c72b0", "warning": "#e69f00", "critical": "#d62728"}
ENDED_BADLY = {"crashed": "process died", "error": "stopped with an error"}
"""Rank statuses that end without an ``oom`` event yet are not a clean end, as the crash marker names them."""
CRASH_COLOR = "#5b0f10"
MEMORY_HEIGHT, KV_HEIGHT = 380, 170
LABEL_ROW_PX = 13
"""One row of phase names (10 px text) below the other."""
TOP_PX, BOTTOM_PX = 70, 50
"""The bands above the rows (the toolbar, the top row's title) and below them (the time axis)."""


def _template() -> dict[str, Any]:
    return require("plotly.io", "the HTML report").templates["plotly_white"].to_plotly_json()


def seconds(ts_ns: int, start_ns: int) -> float:
    return (ts_ns - start_ns) / 1e9


def as_array(values: list[Any], scale: float = 1.0, dtype: str = "float64") -> Any:
    """A float array (NaN where a reading is missing)."""
    np = require("numpy", "the report")
    return (np.array([np.nan if v is None else v for v in values], dtype=np.float64) / scale).astype(dtype)


def _typed(array: Any) -> dict[str, str]:
    """plotly.js's typed-array form of a float array: compact binary in the page instead of decimal text."""
    import base64

    return {"dtype": {"float32": "f4", "float64": "f8"}[str(array.dtype)],
            "bdata": base64.b64encode(array.tobytes()).decode("ascii")}


def _gib(values: list[int | None]) -> dict[str, str]:
    """GiB as 32-bit floats: 7 significant digits (a KiB on a 100 GiB card) at half the page size."""
    return _typed(as_array(values, GIB, "float32"))


def _nearest(data: RankData, ts_ns: int) -> int | None:
    """The driver's used bytes at the drawn point nearest before ``ts_ns``."""
    import bisect

    i = bisect.bisect_right(data.points.ts_ns, ts_ns) - 1
    return data.points.used[max(i, 0)] if data.points.used else None


def _domains(heights: list[int]) -> list[tuple[float, float]]:
    """The rows' vertical spans in the page (top row first), as plotly's subplots lay them out."""
    spacing = min(0.06, 0.3 / len(heights))
    scale = (1 - spacing * (len(heights) - 1)) / sum(heights)
    domains, top = [], 1.0
    for height in heights:
        bottom = max(top - height * scale, 0.0)
        domains.append((bottom, top))
        top = bottom - spacing
    return domains


class _Figure:
    """A plotly figure as the plain dict plotly.js reads, rows stacked on one shared time axis.

    Built directly rather than through plotly's figure objects, which check every property as it is set:
    for a run of many ranks that checking cost more than drawing the page.
    """

    def __init__(self, titles: list[str], heights: list[int]) -> None:
        self.rows = len(heights)
        domains = self.domains = _domains(heights)
        self.layout: dict[str, Any] = {"annotations": [], "shapes": []}
        for row, ((bottom, top), title) in enumerate(zip(domains, titles, strict=True), start=1):
            x, y = self.axes(row)
            xaxis: dict[str, Any] = {"anchor": y, "domain": [0.0, 1.0]}
            if row < self.rows:
                xaxis.update(matches=self.axes(self.rows)[0], showticklabels=False)
            self.layout[f"xaxis{row if row > 1 else ''}"] = xaxis
            self.layout[f"yaxis{row if row > 1 else ''}"] = {"anchor": x, "domain": [bottom, top]}
            self.layout["annotations"].append({"font": {"size": 16}, "showarrow": False, "text": title, "x": 0.5,
                                               "xanchor": "center", "xref": "paper", "y": top, "yanchor": "bottom",
                                               "yref": "paper"})
        self.data: list[dict[str, Any]] = []

    @staticmethod
    def axes(row: int) -> tuple[str, str]:
        suffix = str(row) if row > 1 else ""
        return f"x{suffix}", f"y{suffix}"

    def trace(self, row: int, **trace: Any) -> None:
        x, y = self.axes(row)
        self.data.append({"type": "scatter", **trace, "xaxis": x, "yaxis": y})

    def vrect(self, row: int, x0: float, x1: float, label: str | None, label_row: int = 0, **style: Any) -> None:
        x, y = self.axes(row)
        self.layout["shapes"].append({"type": "rect", "xref": x, "yref": f"{y} domain", "x0": x0, "x1": x1,
                                      "y0": 0, "y1": 1, **style})
        if label is not None:
            self.layout["annotations"].append({"text": label, "x": x0, "xref": x, "xanchor": "left", "y": 1,
                                               "yref": f"{y} domain", "yanchor": "top", "showarrow": False,
                                               "yshift": -LABEL_ROW_PX * label_row, "font": {"size": 10},
                                               "bgcolor": "rgba(255,255,255,0.6)", "borderpad": 0})

    def vline(self, row: int, at: float, line: dict[str, Any]) -> None:
        x, y = self.axes(row)
        self.layout["shapes"].append({"type": "line", "xref": x, "yref": f"{y} domain", "x0": at, "x1": at,
                                      "y0": 0, "y1": 1, "line": line})

    def as_dict(self) -> dict[str, Any]:
        return {"data": self.data, "layout": self.layout}


def build_figure(data: RunData) -> dict[str, Any]:
    """The figure of ``data`` as a plotly dict: two rows per rank (memory; KV blocks when the rank reports them)."""
    template = _template()
    rows: list[tuple[RankData, str]] = []
    for rank in data.ranks:
        rows.append((rank, "memory"))
        if rank.has_kv:
            rows.append((rank, "kv"))
    titles = [f"rank {r.rank}: memory (GiB)" if kind == "memory" else f"rank {r.rank}: KV blocks"
              for r, kind in rows] or ["no samples"]
    heights = [MEMORY_HEIGHT if kind == "memory" else KV_HEIGHT for _, kind in rows] or [1]
    fig = _Figure(titles, heights)
    plot_height = sum(heights) if rows else 400
    legend_shown: set[str] = set()

    def show(key: str) -> bool:
        if key in legend_shown:
            return False
        legend_shown.add(key)
        return True

    for row, (rank, kind) in enumerate(rows, start=1):
        x = as_array([seconds(t, data.start_ns) for t in rank.points.ts_ns], dtype="float32")
        if kind == "memory":
            bottom, top = fig.domains[row - 1]
            _memory_row(fig, row, rank, x, as_array(rank.points.step), data.start_ns, show,
                        (top - bottom) * plot_height)
        else:
            _kv_row(fig, row, rank, x, data.start_ns, show)
        label_at = phase_label_rows(rank, data.start_ns, float(x[0]) if len(x) else 0.0,
                                    float(x[-1]) if len(x) else 0.0)
        for phase, label_row in zip(rank.phases, label_at, strict=True):
            fig.vrect(row, seconds(phase.start_ns, data.start_ns), seconds(phase.end_ns, data.start_ns),
                      phase.name if kind == "memory" else None, label_row,
                      fillcolor=PHASE_COLORS.get(phase.name, "#999999"), opacity=0.09, line={"width": 0},
                      layer="below")
    # The legend stands right of the rows, from the top row's top down: the toolbar (modebar) sits in the
    # band above the rows at the right, and a legend above the rows grew into it as its entries wrapped.
    fig.layout.update(
        template=template, height=plot_height + TOP_PX + BOTTOM_PX, hovermode="x unified",
        legend={"orientation": "v", "yanchor": "top", "y": 1, "xanchor": "left", "x": 1.01},
        margin={"l": 60, "r": 20, "t": TOP_PX, "b": BOTTOM_PX},
    )
    bottom = fig.layout[f"xaxis{fig.rows if fig.rows > 1 else ''}"]
    bottom["title"] = {"text": "seconds since the run started"}
    return fig.as_dict()


def phase_label_rows(rank: RankData, start_ns: int, first: float, last: float, **plan: float) -> list[int]:
    """The row of each phase's name (:func:`~memwatch.report.labels.label_rows`) on an axis that spans the
    rank's points (``first`` to ``last`` seconds) and its phases, as plotly's and matplotlib's autorange do."""
    starts = [seconds(phase.start_ns, start_ns) for phase in rank.phases]
    ends = [seconds(phase.end_ns, start_ns) for phase in rank.phases]
    return label_rows([(at, phase.name) for at, phase in zip(starts, rank.phases, strict=True)],
                      min([first, *starts]), max([last, *ends]), **plan)


def _memory_row(fig: _Figure, row: int, rank: RankData, x: Any, steps: Any, start_ns: int, show: Any,
                row_px: float) -> None:
    hover = "%{y:.3f} GiB"
    xs = _typed(x)
    for key, label in STACK_TERMS:
        fig.trace(row, x=xs, y=_gib(rank.points.stack[key]), name=label, legendgroup=key, showlegend=show(key),
                  stackgroup=f"rank{rank.rank}", mode="lines", line={"width": 0.5, "color": TERM_COLORS[key]},
                  hovertemplate=hover)
    fig.trace(row, x=xs, y=_gib(rank.points.used), customdata=_typed(steps), name="driver used",
              legendgroup="used", showlegend=show("used"), mode="lines", line={"width": 1.4, "color": "#222222"},
              hovertemplate="%{y:.3f} GiB (step %{customdata:,.0f})")  # the one trace that shows the step
    fig.trace(row, x=xs, y=_gib(rank.points.budget), name="budget (total × utilization)", legendgroup="budget",
              showlegend=show("budget"), mode="lines", line={"width": 1.2, "color": "#2ca02c", "dash": "dash"},
              hovertemplate=hover)
    if rank.total_bytes and len(x):
        fig.trace(row, x=[float(x[0]), float(x[-1])], y=[rank.total_bytes / GIB] * 2, name="GPU total",
                  legendgroup="total", showlegend=show("total"), mode="lines",
                  line={"width": 1, "color": "#7f7f7f", "dash": "dot"}, hovertemplate="%{y:.2f} GiB")
    top = (rank.total_bytes or max((u or 0) for u in rank.points.used or [0])) / GIB
    # Markers of flags close in time stack downwards from the top, ~MARK_PX apart on the row's height.
    step_y = top * 1.08 * MARK_PX / row_px
    for severity, flags, levels in flag_levels(rank, start_ns, float(x[0]) if len(x) else 0.0,
                                               float(x[-1]) if len(x) else 0.0):
        fig.trace(row, x=[seconds(f.ts_ns, start_ns) for f in flags], y=[top - level * step_y for level in levels],
                  mode="markers", marker={"symbol": "triangle-down", "size": 11, "color": SEVERITY_COLORS[severity]},
                  name=f"flag ({severity})", legendgroup=f"flag-{severity}", showlegend=show(f"flag-{severity}"),
                  text=[f"{f.kind} at step {f.step:,}: {f.message}" for f in flags], hovertemplate="%{text}")
    if rank.ooms:
        fig.trace(row, x=[seconds(e.ts_ns, start_ns) for e in rank.ooms],
                  y=[(_nearest(rank, e.ts_ns) or 0) / GIB for e in rank.ooms], mode="markers",
                  marker={"symbol": "x", "size": 16, "color": "#d62728", "line": {"width": 2}},
                  name="out of memory", legendgroup="oom", showlegend=show("oom"),
                  text=[_oom_text(e.step, e.data) for e in rank.ooms], hovertemplate="%{text}")
        for event in rank.ooms:
            fig.vline(row, seconds(event.ts_ns, start_ns), {"color": "#d62728", "width": 1.5})
    end = crash_point(rank)
    if end is not None:
        fig.trace(row, x=[seconds(end.ts_ns, start_ns)], y=[(end.used or 0) / GIB], mode="markers",
                  marker={"symbol": "star", "size": 16, "color": CRASH_COLOR, "line": {"width": 1, "color": "white"}},
                  name="crash (no OOM event)", legendgroup="crash", showlegend=show("crash"), text=[end.text],
                  hovertemplate="%{text}")
        fig.vline(row, seconds(end.ts_ns, start_ns), {"color": CRASH_COLOR, "width": 1.5, "dash": "dash"})


def flag_levels(rank: RankData, start_ns: int, first: float, last: float,
                **plan: float) -> list[tuple[str, list[Flag], list[int]]]:
    """Per severity (in :data:`SEVERITIES` order, those present): its flags and each one's stacking level
    (:func:`~memwatch.report.labels.mark_levels` over all the rank's flags on an axis from ``first`` to
    ``last`` seconds), so a warning and a critical at one step both show. A severity outside
    :data:`~memwatch.flags.SEVERITIES` has no colour and is left out."""
    flags = sorted(rank.flags, key=lambda f: f.ts_ns)
    xs = [seconds(f.ts_ns, start_ns) for f in flags]
    levels = mark_levels(xs, min([first, *xs]), max([last, *xs]), **plan)
    return [(severity, [f for f in flags if f.severity == severity],
             [level for f, level in zip(flags, levels, strict=True) if f.severity == severity])
            for severity in SEVERITIES if any(f.severity == severity for f in flags)]


class CrashPoint(NamedTuple):
    ts_ns: int
    step: int
    used: int | None
    text: str


def crash_point(rank: RankData) -> CrashPoint | None:
    """Where a rank that ended badly without an ``oom`` event stopped (a process killed outside PyTorch's
    allocator leaves none): its last point's time, step and driver reading, and a sentence for it; ``None``
    for any other rank."""
    words = ENDED_BADLY.get(rank.status or "")
    if words is None or rank.ooms or not rank.points.ts_ns:
        return None
    step = rank.points.step[-1]
    return CrashPoint(rank.points.ts_ns[-1], step, rank.points.used[-1],
            f"rank {rank.rank}: {words} after step {step:,}, with no out-of-memory error recorded")


def _oom_text(step: int, data: dict[str, Any]) -> str:
    requested = data.get("requested_bytes")
    asked = f": {requested / GIB:.3f} GiB requested" if isinstance(requested, int) else ""
    return f"out of memory at step {step:,}{asked}"


def _kv_row(fig: _Figure, row: int, rank: RankData, x: Any, start_ns: int, show: Any) -> None:
    hover = "%{y:,.0f} blocks"
    xs = _typed(x)
    fig.trace(row, x=xs, y=_typed(as_array(rank.points.kv_used, dtype="float32")), name="KV blocks used",
              legendgroup="kv_used", showlegend=show("kv_used"), mode="lines",
              line={"width": 1.2, "color": "#55a868"}, fill="tozeroy", hovertemplate=hover)
    fig.trace(row, x=xs, y=_typed(as_array(rank.points.kv_total, dtype="float32")), name="KV blocks total",
              legendgroup="kv_total", showlegend=show("kv_total"), mode="lines",
              line={"width": 1.2, "color": "#222222", "dash": "dash"}, hovertemplate=hover)
    if rank.preemptions:
        import bisect

        ys = []
        for event in rank.preemptions:
            i = max(bisect.bisect_right(rank.points.ts_ns, event.ts_ns) - 1, 0)
            ys.append(rank.points.kv_used[i] if rank.points.kv_used else 0)
        fig.trace(row, x=[seconds(e.ts_ns, start_ns) for e in rank.preemptions], y=ys, mode="markers",
                  marker={"symbol": "diamond", "size": 8, "color": "#e69f00"}, name="preemption",
                  legendgroup="preemption", showlegend=show("preemption"),
                  text=[f"{int(e.data.get('count', 1) or 1)} preempted at step {e.step:,}" for e in rank.preemptions],
                  hovertemplate="%{text}")
