"""Post-mortem reports on a recorded run: ``check`` (the ledger per rank and every flag) and ``explain``.

Both replay the run's stored samples and events through the detectors (:func:`memwatch.detectors.replay`)
rather than trusting the ``flags`` table, which only holds what a live sidecar raised; the replay is
the same code, so a run recorded without detectors gets the same answers.
"""

from memwatch.report.check import CheckReport, check_records, check_run, render_check
from memwatch.report.explain import Explanation, explain_records, explain_run, render_explanation
from memwatch.report.stored import stored_records

__all__ = [
    "CheckReport",
    "Explanation",
    "check_records",
    "check_run",
    "explain_records",
    "explain_run",
    "render_check",
    "render_explanation",
    "stored_records",
]
