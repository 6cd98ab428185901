"""``memwatch runs``: the runs in the database, newest first."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import click

from ..identity import describe, stored_places
from ..losses import lost_per_run
from ..sidecar.rejected_rings import set_aside_notes
from ..store import open_store
from ..store.run_model import load_runs
from ..terminal import printable
from .options import db_option, int_range, json_option


@click.command("runs")
@db_option
@json_option
@click.option("-n", "--limit", type=int_range(0), default=20, show_default=True, help="How many runs to show.")
def command(db_path: Path | None, as_json: bool, limit: int) -> None:
    """List recorded runs: id, engine, model, ranks, status, start and GPU."""
    db = open_store(db_path, readonly=True)
    runs = [model.run for model in load_runs(db, limit)]
    lost = lost_per_run(db)
    places = stored_places(db)
    if as_json:
        click.echo(json.dumps([{**run.to_dict(), "lost_samples": lost.get(run.run_id, 0),
                                "where": places.get(run.run_id, {})} for run in runs], indent=2))
        return
    if not runs:
        click.echo("no runs recorded yet; try `memwatch demo`")
        for line in set_aside_notes(db):
            click.echo(line)
        return
    click.echo(f"{'RUN':<13} {'STARTED':<19} {'DURATION':>9} {'STATUS':<8} {'RANKS':>5} {'LOST':>7}  {'ENGINE':<10} "
               "MODEL / GPU")
    for run in runs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((run.started_ns or 0) / 1e9))
        duration = "-" if run.duration_ns is None else f"{run.duration_ns / 1e9:.1f}s"
        gpu = _gpu(run.gpu_name, run.gpu_total_bytes)
        click.echo(
            f"{run.run_id:<13} {started:<19} {duration:>9} {run.status or '?':<8} {run.rank_count or 1:>5} "
            f"{lost.get(run.run_id, 0):>7}  {printable(run.engine or '-'):<10} {printable(run.model or '-')}"
            + (f" / {printable(gpu)}" if gpu else "")
        )
        if run.run_id in places:  # the container and pod it ran in
            click.echo(f"{'':<13} in {printable(describe(places[run.run_id]))}")
    for line in set_aside_notes(db):
        click.echo(line)


_SIZE_IN_NAME = re.compile(r"\d+(\.\d+)?\s*(GiB|GB|TiB|TB)\b", re.IGNORECASE)


def _gpu(name: str | None, total_bytes: int | None) -> str:
    """The GPU's name with its memory, unless the name already says it (``NVIDIA H100 80GB HBM3``).

    The memory is added the way such names say it, ``24GiB``, so that one kind of GPU reads one way in the list
    whether its name carried its size or not."""
    if not total_bytes or (name and _SIZE_IN_NAME.search(name)):
        return name or ""
    return f"{name or '?'} {size_label(total_bytes)}"


def size_label(total_bytes: int) -> str:
    """Device memory as a GPU's name gives it: ``16GiB``, ``22.49GiB`` (GiB, at most two decimals, no space)."""
    return f"{total_bytes / 2**30:.2f}".rstrip("0").rstrip(".") + "GiB"
