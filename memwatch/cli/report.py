"""``memwatch report RUN -o FILE``: a run as a self-contained HTML page or a PNG image; ``--json``: its numbers."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import UsageError
from ..report.output import write_report
from ..report.series import DEFAULT_BUCKETS
from ..store import open_store
from .options import db_option, json_option, run_argument


@click.command("report")
@run_argument
@db_option
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, path_type=Path),
              help="FILE.html (interactive page, opens offline) or FILE.png (the same figure as an image).")
@click.option("--buckets", type=click.IntRange(50, 100_000), default=DEFAULT_BUCKETS, show_default=True,
              help="Time buckets per rank for long runs (each keeps its min and max, so no peak is lost).")
@json_option
def command(run: str, db_path: Path | None, output: Path | None, buckets: int, as_json: bool) -> None:
    """Write a report of a recorded run: a self-contained HTML page or a PNG image.

    RUN is a run id, a unique prefix, or `latest`.

    The HTML page holds everything in one file (plotly's JavaScript inlined; it makes no network
    request): per rank the ledger stacked against total × utilization with the driver's used line,
    KV blocks and preemptions, phases shaded, flags and the out-of-memory marked; a summary table, the
    flags and the `explain` text. The PNG is the same figure. Prints the file's path.

    With --json, prints the report's numbers instead (-o is then optional, and the file's path is under
    `path`): the shared quantities under the keys `check` and `explain` give them, each rank's summary row
    under `ranks`, and the explanation.
    """
    if output is None and not as_json:
        raise UsageError("name the report file with -o FILE.html or -o FILE.png, or ask for its numbers with --json")
    db = open_store(db_path, readonly=True)
    written = None if output is None else write_report(db, run, output, buckets=buckets)
    if not as_json:
        click.echo(str(written))
        return
    from ..report.numbers import report_numbers

    numbers = report_numbers(db, run)
    if written is not None:
        numbers["path"] = str(written)
    click.echo(json.dumps(numbers, indent=2))
