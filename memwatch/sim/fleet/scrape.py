"""Scraping a sidecar's ``/metrics`` as a router does: HTTP on loopback and a standard Prometheus text parser.

The parser is ``prometheus_client``'s ``text_string_to_metric_families`` (the client library Prometheus
publishes), so the router reads the exposition exactly as any scraper would, not through memwatch's own
code. A sidecar serves one engine; an engine with several tensor-parallel ranks has one series per rank,
and :class:`Scrape` takes the tightest of them (the smallest headroom, the largest usage), as a pod's
endpoint would.
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from memwatch.errors import UnavailableError

SCRAPE_TIMEOUT_S = 5.0
"""The bound on one scrape (a sidecar on a loaded machine may take a moment to render)."""


def _parser():  # type: ignore[no-untyped-def]
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ModuleNotFoundError:
        raise UnavailableError("the fleet's router parses /metrics with prometheus_client; "
                               "install it: pip install 'memwatch[fleet]'") from None
    return text_string_to_metric_families


@dataclass
class Scrape:
    """One scrape's samples: metric name -> [(labels, value)], for the series of every rank."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=lambda: defaultdict(list))

    def values(self, name: str, **labels: str) -> list[float]:
        """Every rank's value of ``name`` whose labels include ``labels``."""
        return [value for found, value in self.samples.get(name, [])
                if all(found.get(key) == wanted for key, wanted in labels.items())]

    def lowest(self, name: str, **labels: str) -> float | None:
        """The tightest rank's value of a headroom gauge (None when no rank exports it)."""
        values = self.values(name, **labels)
        return min(values) if values else None

    def highest(self, name: str, **labels: str) -> float | None:
        """The tightest rank's value of a usage gauge (None when no rank exports it)."""
        values = self.values(name, **labels)
        return max(values) if values else None


def keep_families(text: str, names: frozenset[str]) -> str:
    """The exposition's lines of the metric families in ``names`` (samples, HELP and TYPE), as a scraper's
    ``metric_relabel_configs`` keep rule would leave them, so the parser reads only what the router uses."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[2] in names:
                kept.append(line)
            continue
        end = len(line)
        for stop in ("{", " "):
            found = line.find(stop)
            if 0 <= found < end:
                end = found
        if line[:end] in names:
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse(text: str, keep: frozenset[str] | None = None) -> Scrape:
    """Parse an exposition with the Prometheus client's parser (only the families in ``keep``, when given)."""
    scrape = Scrape()
    if keep is not None:
        text = keep_families(text, keep)
    for family in _parser()(text):
        for sample in family.samples:
            scrape.samples[sample.name].append((dict(sample.labels), float(sample.value)))
    return scrape


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Straight to the sidecar on loopback, whatever proxy the environment names."""


def scrape(url: str, keep: frozenset[str] | None = None) -> Scrape:
    """GET ``url`` and parse it (the families in ``keep``); one clear error when the sidecar does not answer."""
    try:
        with _OPENER.open(url, timeout=SCRAPE_TIMEOUT_S) as reply:
            text = reply.read().decode("utf-8")
    except OSError as exc:
        raise UnavailableError(f"cannot scrape {url}: {exc}") from None
    return parse(text, keep)
