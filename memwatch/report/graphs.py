"""Which ranks of a stored run hold CUDA graphs outside their engine's KV budget, for every page that says so.

``check``, ``explain`` and the report each show this finding; the bytes come from the one pair of
functions ``check`` defines (:func:`memwatch.report.check.graphs_captured_after_sizing` and
:func:`memwatch.report.check.graphs_outside_budget`), fed the same summaries and capture times, so the
number is the same wherever it is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from memwatch.detectors import RankSummary
from memwatch.records import Event
from memwatch.report.check import (
    GRAPHS_OUTSIDE_BUDGET,
    capture_ns,
    graphs_captured_after_sizing,
    graphs_outside_budget,
)

if TYPE_CHECKING:
    from memwatch.store.run_model import StoredRun


def stored_graphs_outside_budget(model: StoredRun) -> dict[int, int]:
    """Per rank, the bytes of CUDA graphs captured after sizing that the run's engine leaves out of its
    budget; ranks without that finding are absent (an engine that counts its graphs has none)."""
    engine = model.run.engine
    if engine not in GRAPHS_OUTSIDE_BUDGET:
        return {}
    return graphs_per_rank(engine, model.summaries, model.capture_ns)


def replayed_graphs_outside_budget(engine: str | None, summaries: Mapping[int, RankSummary],
                                   events: Iterable[Event]) -> dict[int, int]:
    """The same from a replay of the run's records: the capture times from its events."""
    if engine not in GRAPHS_OUTSIDE_BUDGET:
        return {}
    return graphs_per_rank(engine, summaries, capture_ns(events))


def graphs_per_rank(engine: str, summaries: Mapping[int, RankSummary], capture: Mapping[int, int]) -> dict[int, int]:
    found: dict[int, int] = {}
    for rank, summary in sorted(summaries.items()):
        graphs = graphs_outside_budget(engine, graphs_captured_after_sizing(summary, capture.get(rank)),
                                       summary.last_terms)
        if graphs is not None:
            found[rank] = graphs
    return found
