"""``memwatch report RUN -o FILE``: a run as a self-contained HTML page or a PNG image."""

from __future__ import annotations

from pathlib import Path

import click

from ..report.output import write_report
from ..report.series import DEFAULT_BUCKETS
from ..store import open_store
from .options import db_option, run_argument


@click.command("report")
@run_argument
@db_option
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="FILE.html (interactive page, opens offline) or FILE.png (the same figure as an image).")
@click.option("--buckets", type=click.IntRange(50, 100_000), default=DEFAULT_BUCKETS, show_default=True,
              help="Time buckets per rank for long runs (each keeps its min and max, so no peak is lost).")
def command(run: str, db_path: Path | None, output: Path, buckets: int) -> None:
    """Write a report of a recorded run: a self-contained HTML page or a PNG image.

    RUN is a run id, a unique prefix, or `latest`.

    The HTML page holds everything in one file (plotly's JavaScript inlined; it makes no network
    request): per rank the ledger stacked against total × utilization with the driver's used line,
    KV blocks and preemptions, phases shaded, flags and the out-of-memory marked; a summary table, the
    flags and the `explain` text. The PNG is the same figure. Prints the file's path.
    """
    click.echo(write_report(open_store(db_path, readonly=True), run, output, buckets=buckets))
