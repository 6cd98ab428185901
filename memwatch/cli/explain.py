"""``memwatch explain RUN``: the post-mortem of a recorded run in plain words."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..detectors import DetectorConfig
from ..losses import render_losses, run_losses
from ..report import explain_run, render_explanation
from ..store import open_store
from ..store.queries import get_run
from .options import db_option, json_option, thresholds_option


@click.command("explain")
@click.argument("run")
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
    explanation = explain_run(db, run, detector_config)
    info = get_run(db, run)
    losses = run_losses(db, info.run_id)
    if as_json:
        click.echo(json.dumps({**explanation.to_dict(), "lost_samples": losses.to_dict()}, indent=2))
    else:
        click.echo("\n".join([render_explanation(explanation), *render_losses(losses, info.started_ns)]))
