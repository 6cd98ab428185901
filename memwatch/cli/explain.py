"""``memwatch explain RUN``: the post-mortem of a recorded run in plain words."""

from __future__ import annotations

from pathlib import Path

import click

from ..detectors import DetectorConfig
from ..identity import describe, stored_places
from ..report import render_explanation
from ..report.explain import explain_stored
from ..store import open_store
from ..store.run_model import load_run
from ..terminal import printable
from .options import db_option, json_option, run_argument, thresholds_option
from .output import echo_report


@click.command("explain")
@run_argument
@db_option
@json_option
@thresholds_option
def command(run: str, db_path: Path | None, as_json: bool, detector_config: DetectorConfig | None) -> None:
    """Explain how a recorded run ended. RUN is a run id, a unique prefix, or `latest`.

    For an out-of-memory: the last window before it, which ledger term grew (by how much, since
    when), and every flag raised before it with its lead in steps and seconds. For a healthy run:
    each rank's tightest moment. The stored samples and events are replayed through the detectors
    (the source of truth); --json carries every number under stable keys.
    """
    db = open_store(db_path, readonly=True)
    model = load_run(db, run, detector_config)
    explanation, info = explain_stored(model), model.run
    report, text = explanation.to_dict(), render_explanation(explanation)
    report.update(model.figures.to_dict())
    place = stored_places(db, info.run_id).get(info.run_id)
    if place:  # which container and pod it was, for a fleet's post-mortem
        report["where"] = place
        text += f"\nIt ran in {printable(describe(place))}."
    echo_report(db, info.run_id, info.started_ns, report, text, as_json)
