"""The Prometheus scrape endpoint: the text exposition format rendered straight from the state.

Names and labels are what OpenTelemetry's Prometheus exporter makes of the same instruments (dots
become underscores, unit ``By`` adds ``_bytes``, a monotonic sum adds ``_total``, the resource
becomes ``target_info``), plus dcgm-exporter's names for the GPU (``UUID``, ``Hostname``; its name as ``gpu_name``),
so that a series joins ``DCGM_FI_*`` series. The lines are built directly from the :class:`ExportState` snapshot, with
each rank's label set rendered once: going through the SDK's aggregation and a generic exposition
library costs twenty times as much per series, and a scrape of 64 ranks must stay cheap for the
sidecar. It listens on 127.0.0.1 unless a host is given, on an event loop of its own that no client can
starve (:mod:`.http_serving`); rendering runs on a few worker threads.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from ..identity import prometheus_labels
from .headroom import render_headroom
from .http_serving import HttpListener, Reply
from .instruments import BUNDLE_METRICS, FLAGS_METRIC, METRICS, RINGS_REFUSED
from .state import ExportState, RankSeries

log = logging.getLogger("memwatch.export")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(name: str, unit: str) -> str:
    """``hw.gpu.memory.usage`` in ``By`` -> ``hw_gpu_memory_usage_bytes`` (a counter adds ``_total`` on top)."""
    return _INVALID.sub("_", name) + ("_bytes" if unit == "By" else "")


_UNSAFE_IN_LABEL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                              "\ud800-\udfff]")
"""What a label value never carries as it is: control characters (C0, DEL, C1: newline, CR, ESC, BEL, so no
terminal or OSC 52 clipboard sequence), bidi overrides, and lone surrogates (not UTF-8: the scrape could not be
encoded at all)."""


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\\\x{code:02x}" if code < 0x100 else f"\\\\u{code:04x}"


def _escape(value: Any) -> str:
    """A label value for the exposition: backslash and quote escaped, every unsafe character written as the
    visible text ``\\xNN`` or ``\\uNNNN`` (its backslash escaped too), so any parser reads it back as plain text."""
    text = str(value).replace("\\", r"\\").replace('"', r"\"")
    return _UNSAFE_IN_LABEL.sub(_visible, text)


def render_labels(attributes: dict[str, Any]) -> str:
    """``{"run_id": "a", "hw.id": 0}`` -> ``run_id="a",hw_id="0"`` (no braces, so more can follow)."""
    return ",".join(f'{_INVALID.sub("_", key)}="{_escape(value)}"' for key, value in attributes.items())


def _labels(series: RankSeries) -> tuple[str, str]:
    """The rank's label text, and with its hardware's (``hw.*`` metrics): rendered once, a rank's labels never
    change."""
    cached = series.rendered.get("prometheus_labels")
    if cached is None:
        cached = (render_labels({**prometheus_labels(series.attributes), **series.dcgm}),
                  render_labels({**prometheus_labels({**series.attributes, **series.hardware}), **series.dcgm}))
        series.rendered["prometheus_labels"] = cached
    return cached


@functools.lru_cache(maxsize=256)
def _flag_labels(kind: str, severity: str) -> str:
    """``kind="…",severity="…"``: a handful of pairs, each series of every rank on every scrape, escaped once."""
    return f'kind="{_escape(kind)}",severity="{_escape(severity)}"'


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def render(state: ExportState, resource: dict[str, Any] | None = None, *, headroom: bool = True) -> str:
    """Every metric of every live rank in the Prometheus text format, and (``headroom``) each engine's headroom."""
    ranks = state.snapshot()
    labelled = [(series, *_labels(series)) for series in ranks]
    out: list[str] = []
    if resource:
        out += ["# HELP target_info Target metadata", "# TYPE target_info gauge",
                f"target_info{{{render_labels(resource)}}} 1"]
    for spec in METRICS:
        name = prometheus_name(spec.name, spec.unit)
        counter = spec.kind == "counter"
        sample = name + "_total" if counter else name
        out += [f"# HELP {sample} {spec.description}", f"# TYPE {sample} {'counter' if counter else 'gauge'}"]
        hardware = spec.name.startswith("hw.")
        read, append = spec.read, out.append
        for series, base, hw in labelled:
            value = read(series)
            if value is not None:  # an int or a float prints as _number prints it (a float's str is its repr)
                text = value if type(value) in (int, float) else _number(value)
                append(f"{sample}{{{hw if hardware else base}}} {text}")
    flags = prometheus_name(FLAGS_METRIC, "") + "_total"
    out += [f"# HELP {flags} Flags the live detectors raised, by kind and severity", f"# TYPE {flags} counter"]
    for series, base, _ in labelled:
        raised = state.raised_flags(series)
        cached = series.rendered.get("prometheus_flags")
        if cached is None or cached[0] != raised:  # a flag is rare: most scrapes reuse the rank's block
            cached = (raised, [f'{flags}{{{base},{_flag_labels(kind, severity)}}} {count}'
                               for kind, severity, count in state._all_flag_counts(raised)])
            series.rendered["prometheus_flags"] = cached
        out += cached[1]
    if headroom:
        out += render_headroom(state.engines(ranks), lambda attributes: render_labels(prometheus_labels(attributes)),
                               _escape)
    refused = state.refused_rings()
    if refused is not None:
        name = prometheus_name(RINGS_REFUSED.name, RINGS_REFUSED.unit)
        out += [f"# HELP {name} {RINGS_REFUSED.description}", f"# TYPE {name} gauge"]
        out += [f'{name}{{reason="{_escape(reason)}"}} {n}' for reason, n in refused.items()]
    bundles = state.bundle_counts()
    if bundles is not None:
        for spec in BUNDLE_METRICS:
            name = prometheus_name(spec.name, spec.unit) + ("_total" if spec.kind == "counter" else "")
            out += [f"# HELP {name} {spec.description}", f"# TYPE {name} {spec.kind}", f"{name} {spec.read(bundles)}"]
    return "\n".join(out) + "\n"


METRICS_PATHS = ("/metrics", "/")
"""What a scrape asks for; any other path is answered 404 on the listener's loop, never queued for a worker."""


class PrometheusEndpoint:
    """An HTTP server that answers ``GET /metrics`` with :func:`render` of the state."""

    def __init__(self, host: str, port: int, state: ExportState, resource: dict[str, Any] | None = None) -> None:
        self.host = host
        self.state = state
        self.resource = resource
        self._listener = HttpListener(host, port, self._route, name="memwatch-prometheus", option="--prometheus",
                                      offload=METRICS_PATHS)  # rendering runs on the listener's few workers

    def start(self) -> None:
        """Listen; raises :class:`UnavailableError` on a taken port."""
        self._listener.start()

    def _route(self, path: str) -> Reply:
        if path not in METRICS_PATHS:
            return Reply(404, b"memwatch serves /metrics\n")
        try:
            return Reply(200, render(self.state, self.resource).encode(), CONTENT_TYPE)
        except Exception as exc:  # a scrape must never take the sidecar's log down with a traceback
            log.error("prometheus: cannot render /metrics: %s", exc)
            return Reply(500, b"memwatch could not render its metrics; see the sidecar's log\n")

    @property
    def port(self) -> int:
        """The port it listens on (the one the system chose, for port 0)."""
        return self._listener.port

    @property
    def listener(self) -> HttpListener:
        """The listener itself, for its counters (accepted, answered, evicted, expired, refused)."""
        return self._listener

    def close(self) -> None:
        self._listener.close()
