"""``memwatch check RUN``: the ledger per rank and every flag; exit 1 on a flag of warning or worse."""

from __future__ import annotations

from pathlib import Path

import click

from ..detectors import DetectorConfig
from ..report import render_check
from ..report.check import check_stored
from ..store import open_store
from ..store.run_model import load_run
from .options import db_option, json_option, run_argument, thresholds_option
from .output import echo_report


@click.command("check")
@run_argument
@db_option
@json_option
@thresholds_option
def command(run: str, db_path: Path | None, as_json: bool, detector_config: DetectorConfig | None) -> None:
    """Check a recorded run's memory ledger. RUN is a run id, a unique prefix, or `latest`.

    The run's stored samples and events are replayed through the detectors, which are the source of
    truth here (the flags a live sidecar stored are not read). Exit 0 when no flag is warning or
    worse, 1 otherwise.
    """
    db = open_store(db_path, readonly=True)
    model = load_run(db, run, detector_config)
    report, info = check_stored(model), model.run
    echo_report(db, info.run_id, info.started_ns, report.to_dict(), render_check(report), as_json)
    if report.failed:
        raise SystemExit(1)
