"""``report --json``: the numbers the report shows, under the names every other command gives them.

The run's shared quantities (:mod:`memwatch.store.run_figures`) at the top, under the same keys as ``check`` and
``explain``; each rank's summary row (:mod:`memwatch.report.facts`) under ``ranks``, its shared quantities renamed
to those keys (``non_pytorch_bytes`` is ``non_torch_at_sizing_bytes``, ``kv_bytes`` is ``kv_cache_bytes``,
``flags`` is ``flag_counts``) and its end margin beside them; and the explanation the page prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memwatch.report.explain import explain_stored
from memwatch.report.facts import RankFacts, run_facts
from memwatch.report.run_data import run_data_of
from memwatch.store.run_figures import RunTruth
from memwatch.store.run_model import load_run

if TYPE_CHECKING:
    from memwatch.store.db import Database

RENAMED = {"non_pytorch_bytes": "non_torch_at_sizing_bytes", "kv_bytes": "kv_cache_bytes", "flags": "flag_counts"}
"""The summary table's names for shared quantities, and the names every ``--json`` gives them."""

JSON_BUCKETS = 50
"""The numbers need no drawing: the fewest buckets a report takes."""


def rank_numbers(facts: RankFacts, truth: RunTruth) -> dict[str, Any]:
    """One rank's summary row with the shared names, and its margin at the end (the run's one definition)."""
    row = {RENAMED.get(key, key): value for key, value in facts.to_dict().items()}
    shared = truth.rank(facts.rank)
    row["oom_margin_bytes"] = None if shared is None else shared.oom_margin_bytes
    return row


def report_numbers(db: Database, ref: str) -> dict[str, Any]:
    """The report of run ``ref`` as JSON: what the page's summary and explanation say, in numbers."""
    model = load_run(db, ref)
    data = run_data_of(model, JSON_BUCKETS)
    run, truth = model.run, model.figures
    explanation = explain_stored(model)
    return {
        "run_id": run.run_id, "status": run.status, "engine": run.engine, "model": run.model, "gpu": run.gpu_name,
        **truth.to_dict(),
        "ranks": [rank_numbers(facts, truth) for facts in run_facts(data)],
        "outcome": explanation.outcome, "explanation": list(explanation.sentences),
    }
