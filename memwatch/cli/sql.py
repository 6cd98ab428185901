"""``memwatch sql "SELECT …"``: ad-hoc queries on the store, which stays unchanged whatever is asked."""

from __future__ import annotations

from pathlib import Path

import click

from ..store import default_db_path
from ..store.readonly_sql import run_query
from .options import db_option, json_option
from .output import csv_option, pick_format, write_rows


@click.command("sql")
@click.argument("query")
@db_option
@json_option
@csv_option
def command(query: str, db_path: Path | None, as_json: bool, as_csv: bool) -> None:
    """Run one read-only SQL query on the database and print its rows.

    The file is opened read-only, with PRAGMA query_only on; INSERT, UPDATE, DELETE, DROP, CREATE,
    ATTACH and pragmas that set a value are refused (exit 2). --json writes one object per row.
    """
    fmt = pick_format(as_json, as_csv)
    columns, rows = run_query(db_path or default_db_path(), query)
    write_rows(columns, rows, fmt)
