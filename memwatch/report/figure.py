"""The report's interactive figure (plotly): per rank, the ledger stacked under the driver's reading,
and KV blocks with preemptions; phases shaded, flags and out-of-memory moments marked.

plotly is imported here only, lazily, by ``memwatch report``: the sidecar and the engine plugin never
load it. Values are drawn in GiB against seconds since the run started; hovering shows bytes as GiB
and the step.
"""

from __future__ import annotations

from typing import Any

from memwatch.errors import UnavailableError
from memwatch.report.run_data import STACK_TERMS, RankData, RunData

GIB = float(1 << 30)
TERM_COLORS = {
    "weights": "#4c72b0", "torch_other": "#8172b3", "kv": "#55a868", "activations": "#dd8452",
    "cache_slack": "#ccb974", "non_torch": "#c44e52",
}
PHASE_COLORS = {"load": "#4c72b0", "warmup": "#dd8452", "kv_alloc": "#55a868", "cudagraph": "#8172b3",
                "serve": "#937860"}
SEVERITY_COLORS = {"info": "#4c72b0", "warning": "#e69f00", "critical": "#d62728"}
MEMORY_HEIGHT, KV_HEIGHT = 380, 170


def _plotly() -> tuple[Any, Any]:
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        raise UnavailableError("the HTML report needs plotly; install it with pip install 'memwatch[report]'") from None
    return go, make_subplots


def seconds(ts_ns: int, start_ns: int) -> float:
    return (ts_ns - start_ns) / 1e9


def as_array(values: list[Any], scale: float = 1.0, dtype: str = "float64") -> Any:
    """A float array (NaN where a reading is missing): plotly embeds arrays as compact binary, lists as text."""
    import numpy as np

    return (np.array([np.nan if v is None else v for v in values], dtype=np.float64) / scale).astype(dtype)


def _gib(values: list[int | None]) -> Any:
    """GiB as 32-bit floats: 7 significant digits (a KiB on a 100 GiB card) at half the page size."""
    return as_array(values, GIB, "float32")


def _nearest(data: RankData, ts_ns: int) -> int | None:
    """The driver's used bytes at the drawn point nearest before ``ts_ns``."""
    import bisect

    i = bisect.bisect_right(data.points.ts_ns, ts_ns) - 1
    return data.points.used[max(i, 0)] if data.points.used else None


def build_figure(data: RunData) -> Any:
    """The plotly figure of ``data``: two rows per rank (memory; KV blocks when the rank reports them)."""
    go, make_subplots = _plotly()
    rows: list[tuple[RankData, str]] = []
    for rank in data.ranks:
        rows.append((rank, "memory"))
        if rank.has_kv:
            rows.append((rank, "kv"))
    titles = [f"rank {r.rank}: memory (GiB)" if kind == "memory" else f"rank {r.rank}: KV blocks"
              for r, kind in rows]
    heights = [MEMORY_HEIGHT if kind == "memory" else KV_HEIGHT for _, kind in rows]
    fig = make_subplots(rows=max(len(rows), 1), cols=1, shared_xaxes=True,
                        vertical_spacing=min(0.06, 0.3 / max(len(rows), 1)),
                        subplot_titles=titles or ["no samples"], row_heights=heights or [1])
    legend_shown: set[str] = set()

    def show(key: str) -> bool:
        if key in legend_shown:
            return False
        legend_shown.add(key)
        return True

    for row, (rank, kind) in enumerate(rows, start=1):
        x = as_array([seconds(t, data.start_ns) for t in rank.points.ts_ns], dtype="float32")
        steps = as_array(rank.points.step)
        if kind == "memory":
            _memory_row(go, fig, row, rank, x, steps, data.start_ns, show)
        else:
            _kv_row(go, fig, row, rank, x, steps, data.start_ns, show)
        for phase in rank.phases:
            label = {"annotation_text": phase.name, "annotation_position": "top left",
                     "annotation_font_size": 10} if kind == "memory" else {}
            fig.add_vrect(x0=seconds(phase.start_ns, data.start_ns), x1=seconds(phase.end_ns, data.start_ns),
                          fillcolor=PHASE_COLORS.get(phase.name, "#999999"), opacity=0.09, line_width=0,
                          layer="below", row=row, col=1, **label)
    plot_height = sum(heights) if heights else 400
    fig.update_layout(
        height=plot_height + 150, hovermode="x unified", template="plotly_white",
        legend={"orientation": "h", "yanchor": "bottom", "y": 1 + 30 / plot_height, "xanchor": "left", "x": 0},
        margin={"l": 60, "r": 20, "t": 100, "b": 50},
    )
    fig.update_xaxes(title_text="seconds since the run started", row=max(len(rows), 1), col=1)
    return fig


def _memory_row(go: Any, fig: Any, row: int, rank: RankData, x: Any, steps: Any, start_ns: int,
                show: Any) -> None:
    hover = "%{y:.3f} GiB"
    for key, label in STACK_TERMS:
        fig.add_trace(go.Scatter(
            x=x, y=_gib(rank.points.stack[key]), name=label, legendgroup=key, showlegend=show(key),
            stackgroup=f"rank{rank.rank}", mode="lines", line={"width": 0.5, "color": TERM_COLORS[key]},
            hovertemplate=hover,
        ), row=row, col=1)
    fig.add_trace(go.Scatter(  # the one trace that carries the step, shown once in the unified hover
        x=x, y=_gib(rank.points.used), customdata=steps, name="driver used", legendgroup="used",
        showlegend=show("used"), mode="lines", line={"width": 1.4, "color": "#222222"},
        hovertemplate="%{y:.3f} GiB (step %{customdata:,.0f})",
    ), row=row, col=1)
    fig.add_trace(go.Scatter(
        x=x, y=_gib(rank.points.budget), name="budget (total × utilization)", legendgroup="budget",
        showlegend=show("budget"), mode="lines", line={"width": 1.2, "color": "#2ca02c", "dash": "dash"},
        hovertemplate=hover,
    ), row=row, col=1)
    if rank.total_bytes and len(x):
        fig.add_trace(go.Scatter(
            x=[x[0], x[-1]], y=[rank.total_bytes / GIB] * 2, name="GPU total", legendgroup="total",
            showlegend=show("total"), mode="lines", line={"width": 1, "color": "#7f7f7f", "dash": "dot"},
            hovertemplate="%{y:.2f} GiB",
        ), row=row, col=1)
    top = (rank.total_bytes or max((u or 0) for u in rank.points.used or [0])) / GIB
    for severity in ("info", "warning", "critical"):
        flags = [f for f in rank.flags if f.severity == severity]
        if flags:
            fig.add_trace(go.Scatter(
                x=[seconds(f.ts_ns, start_ns) for f in flags], y=[top] * len(flags), mode="markers",
                marker={"symbol": "triangle-down", "size": 11, "color": SEVERITY_COLORS[severity]},
                name=f"flag ({severity})", legendgroup=f"flag-{severity}", showlegend=show(f"flag-{severity}"),
                text=[f"{f.kind} at step {f.step:,}: {f.message}" for f in flags], hovertemplate="%{text}",
            ), row=row, col=1)
    if rank.ooms:
        fig.add_trace(go.Scatter(
            x=[seconds(e.ts_ns, start_ns) for e in rank.ooms],
            y=[(_nearest(rank, e.ts_ns) or 0) / GIB for e in rank.ooms], mode="markers",
            marker={"symbol": "x", "size": 16, "color": "#d62728", "line": {"width": 2}},
            name="out of memory", legendgroup="oom", showlegend=show("oom"),
            text=[_oom_text(e.step, e.data) for e in rank.ooms], hovertemplate="%{text}",
        ), row=row, col=1)
        for event in rank.ooms:
            fig.add_vline(x=seconds(event.ts_ns, start_ns), line={"color": "#d62728", "width": 1.5}, row=row, col=1)


def _oom_text(step: int, data: dict[str, Any]) -> str:
    requested = data.get("requested_bytes")
    asked = f": {requested / GIB:.3f} GiB requested" if isinstance(requested, int) else ""
    return f"out of memory at step {step:,}{asked}"


def _kv_row(go: Any, fig: Any, row: int, rank: RankData, x: Any, steps: Any, start_ns: int,
            show: Any) -> None:
    hover = "%{y:,.0f} blocks"
    fig.add_trace(go.Scatter(
        x=x, y=as_array(rank.points.kv_used, dtype="float32"), name="KV blocks used", legendgroup="kv_used",
        showlegend=show("kv_used"), mode="lines", line={"width": 1.2, "color": "#55a868"}, fill="tozeroy",
        hovertemplate=hover,
    ), row=row, col=1)
    fig.add_trace(go.Scatter(
        x=x, y=as_array(rank.points.kv_total, dtype="float32"), name="KV blocks total", legendgroup="kv_total",
        showlegend=show("kv_total"), mode="lines", line={"width": 1.2, "color": "#222222", "dash": "dash"},
        hovertemplate=hover,
    ), row=row, col=1)
    if rank.preemptions:
        import bisect

        ys = []
        for event in rank.preemptions:
            i = max(bisect.bisect_right(rank.points.ts_ns, event.ts_ns) - 1, 0)
            ys.append(rank.points.kv_used[i] if rank.points.kv_used else 0)
        fig.add_trace(go.Scatter(
            x=[seconds(e.ts_ns, start_ns) for e in rank.preemptions], y=ys, mode="markers",
            marker={"symbol": "diamond", "size": 8, "color": "#e69f00"}, name="preemption", legendgroup="preemption",
            showlegend=show("preemption"),
            text=[f"{int(e.data.get('count', 1) or 1)} preempted at step {e.step:,}" for e in rank.preemptions],
            hovertemplate="%{text}",
        ), row=row, col=1)
