"""``memwatch report RUN -o FILE.html``: one self-contained page, plotly's JavaScript inlined.

The page loads nothing from anywhere (no CDN, no fonts, no MathJax), so it opens on a machine with no
network and can be attached to a ticket as one file. It holds the run's facts, a summary table per
rank, every flag, the largest live allocations of an imported memory snapshot, the ``explain``
text, and the figure of :mod:`memwatch.report.figure`.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from typing import Any

from memwatch.report.check import graphs_sentence
from memwatch.report.facts import RankFacts, run_facts
from memwatch.report.figure import build_figure
from memwatch.report.optional import require
from memwatch.report.run_data import RunData
from memwatch.units import format_bytes

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.88em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; } th { background: #f4f4f4; }
td.l, th.l { text-align: left; }
td { white-space: nowrap; } td.l, td.w { white-space: normal; }
pre { background: #f7f7f7; padding: 10px; white-space: pre-wrap; font-size: 0.9em; }
.critical { color: #d62728; font-weight: 600; } .warning { color: #b8860b; } .info { color: #4c72b0; }
"""

_FACT_ROWS: tuple[tuple[str, str], ...] = (
    ("status", "how it ended"), ("samples", "samples"), ("last_step", "last step"),
    ("weights_bytes", "weights"), ("torch_other_bytes", "other long-lived PyTorch"),
    ("activation_reserve_bytes", "activation reserve"), ("non_pytorch_bytes", "non-PyTorch at sizing"),
    ("num_blocks", "KV blocks"), ("kv_bytes", "KV cache"), ("budget_bytes", "budget (total × utilization)"),
    ("peak_used_bytes", "peak driver used"), ("min_free_bytes", "least driver free"),
    ("serving_peak_bytes", "allocator peak while serving"), ("preemptions", "preemptions"),
    ("oom_requested_bytes", "OOM: bytes requested"),
)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "–"
    if key.endswith("_bytes") and isinstance(value, int):
        return html.escape(format_bytes(value))
    if isinstance(value, int):
        return f"{value:,}"
    return html.escape(str(value))


def _time(ns: int | None) -> str:
    return "–" if not ns else datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _summary_table(facts: list[RankFacts]) -> str:
    head = "".join(f"<th>rank {f.rank}</th>" for f in facts)
    body = []
    rows = _FACT_ROWS
    if any(f.cuda_graphs_outside_budget_bytes is not None for f in facts):
        rows += (("cuda_graphs_outside_budget_bytes", "CUDA graphs outside the budget"),)
    for key, label in rows:
        cells = "".join(f"<td>{_cell(key, getattr(f, key))}</td>" for f in facts)
        body.append(f"<tr><th class='l'>{html.escape(label)}</th>{cells}</tr>")
    flags = "".join(
        "<td class='w'>" + (html.escape(", ".join(f"{k} ×{n}" for k, n in sorted(f.flags.items()))) or "none")
        + "</td>"
        for f in facts
    )
    body.append(f"<tr><th class='l'>flags</th>{flags}</tr>")
    return f"<table id='summary'><tr><th class='l'></th>{head}</tr>{''.join(body)}</table>"


def _findings(data: RunData, facts: list[RankFacts]) -> str:
    """What the table's numbers mean when they look wrong but are not: CUDA graphs the engine's budget leaves
    out put driver-used above the budget line on a healthy run; a CPU device has no allocator or driver rows
    to fill (said once, not as a table of unknowns)."""
    engine = data.run.engine
    said = [f"<li>rank {f.rank}: {html.escape(graphs_sentence(engine, f.cuda_graphs_outside_budget_bytes))}.</li>"
            for f in facts if engine is not None and f.cuda_graphs_outside_budget_bytes is not None]
    device = None if data.model is None else data.model.device_note
    cpu = (f"<p id='device'>This run's {html.escape(str(device)).removeprefix('the ')}. The table's empty rows are "
           "why, not unknowns.</p>") if device else ""
    if not said:
        return cpu
    return ("<ul id='findings'>" + "".join(said) + "</ul><p>The timeline draws them above the budget line.</p>" + cpu)


def _flags_table(data: RunData) -> str:
    flags = sorted((f for r in data.ranks for f in r.flags), key=lambda f: f.ts_ns)
    if not flags:
        return "<p>No flags were raised for this run.</p>"
    rows = "".join(
        f"<tr><td>{f.rank}</td><td>{f.step:,}</td><td>{(f.ts_ns - data.start_ns) / 1e9:,.1f}\u00a0s</td>"
        f"<td class='l {html.escape(f.severity)}'>{html.escape(f.severity)}</td>"
        f"<td class='l'>{html.escape(f.kind)}</td>"
        f"<td class='l'>{html.escape(f.message)}</td></tr>" for f in flags
    )
    return ("<table id='flags'><tr><th>rank</th><th>step</th><th>time</th><th class='l'>severity</th>"
            f"<th class='l'>kind</th><th class='l'>message</th></tr>{rows}</table>")


def _snapshot_section(data: RunData) -> str:
    allocations = [e for r in data.ranks for e in r.snapshot if e.kind == "snapshot_allocation"]
    if not allocations:
        return ""
    rows = []
    for event in allocations:
        frames = event.data.get("frames") or []
        where = "<br>".join(html.escape(f"{f.get('name')} ({f.get('filename')}:{f.get('line')})")
                            for f in frames[:3])
        rows.append(f"<tr><td>{event.rank}</td><td>{event.data.get('place')}</td>"
                    f"<td>{_cell('size_bytes', event.data.get('size_bytes'))}</td>"
                    f"<td class='l'>{where or '–'}</td></tr>")
    return ("<h2>Largest live allocations (imported memory snapshot)</h2><table id='snapshot'><tr><th>rank</th>"
            f"<th>#</th><th>size</th><th class='l'>allocated at</th></tr>{''.join(rows)}</table>")


def render_page(data: RunData, explanation: str) -> str:
    """The whole HTML document for ``data`` with ``explanation`` (``memwatch explain``'s text)."""
    pio = require("plotly.io", "the HTML report")
    run = data.run
    figure = build_figure(data)
    plot = pio.to_html(figure, validate=False, full_html=False, include_plotlyjs=True, include_mathjax=False,
                       div_id="memwatch-plot", config={"displaylogo": False, "responsive": True})
    facts = run_facts(data)
    downsampled = any(r.series.downsampled for r in data.ranks)
    note = (" Long ranks are drawn from min/max buckets, so every peak and trough is on the plot."
            if downsampled else "")
    header = (f"{html.escape(run.engine or '?')} · {html.escape(run.model or '?')} · "
              f"{html.escape(run.gpu_name or 'GPU ?')} ({_cell('gpu_total_bytes', run.gpu_total_bytes)}) · "
              f"{run.rank_count or len(data.ranks)} rank(s) · {_time(run.started_ns)} → {_time(run.ended_ns)} · "
              f"status <b>{html.escape(run.status or '?')}</b>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">
<title>memwatch report: run {html.escape(run.run_id)}</title><style>{_STYLE}</style></head>
<body>
<h1>memwatch report: run {html.escape(run.run_id)}</h1>
<p>{header}</p>
<h2>What happened</h2><pre id="explain">{html.escape(explanation)}</pre>
<h2>Summary per rank</h2>{_summary_table(facts)}{_findings(data, facts)}
<h2>Timeline</h2>
<p>Per rank, the ledger stacked up to the driver's used memory against the budget the engine sized for
(total × utilization); below it, KV blocks in use and preemptions. Phases are shaded, flags are triangles
(flags close in time stacked downwards), an out-of-memory is a red cross, and a process that ended without
one (killed, crashed) a dark star at its last sample. Drag to zoom, double-click to reset, hover for
values.{note}</p>
{plot}
<h2>Flags</h2>{_flags_table(data)}
{_snapshot_section(data)}
</body></html>
"""
