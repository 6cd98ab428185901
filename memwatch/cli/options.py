"""Options several commands share, so they read and behave the same everywhere."""

from __future__ import annotations

from pathlib import Path

import click

db_option = click.option(
    "--db",
    "db_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="MEMWATCH_DB",
    help="SQLite database (default: $MEMWATCH_DB, else ~/.local/share/memwatch/memwatch.db).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")
