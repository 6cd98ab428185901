"""``memwatch diff RUN_A RUN_B``: what changed between two runs of the same setup, term by term."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..report.diff import diff_runs, render_diff
from ..store import open_store
from .options import RUN_REF, db_option, json_option


@click.command("diff")
@click.argument("run_a", type=RUN_REF)
@click.argument("run_b", type=RUN_REF)
@db_option
@json_option
def command(run_a: str, run_b: str, db_path: Path | None, as_json: bool) -> None:
    """Compare two recorded runs of the same setup, rank by rank and term by term.

    RUN_A and RUN_B are run ids, unique prefixes or `latest`.

    The KV sizing's terms (weights, activation reserve, non-PyTorch, blocks, budget), what serving did
    (allocator peak while serving, peak driver use, least free, non-PyTorch drift slope, preemptions), the flags
    and how each run ended, plus the engine settings that differ; then every change in one list.
    """
    db = open_store(db_path, readonly=True)
    diff = diff_runs(db, run_a, run_b)
    if not as_json:
        click.echo(render_diff(diff))
        return
    click.echo(json.dumps(diff.to_dict(), indent=2, default=str))  # each run's shared quantities beside its row
