"""``memwatch sql "SELECT …"``: ad-hoc queries on the store, which stays unchanged whatever is asked."""

from __future__ import annotations

from pathlib import Path

import click

from ..store import default_db_path
from ..store.readonly_sql import DEFAULT_TIMEOUT_S, run_query
from .options import Seconds, Text, db_option, int_range, json_option
from .output import csv_option, pick_format, write_rows

TABLE_ROWS = 1000


@click.command("sql")
@click.argument("query", type=Text())
@db_option
@json_option
@csv_option
@click.option("--timeout", "timeout_s", type=Seconds(0), default=DEFAULT_TIMEOUT_S, show_default=True,
              help="Stop the query after this many seconds, rows included (exit 2); 0: no limit.")
@click.option("--max-rows", type=int_range(1), default=TABLE_ROWS, show_default=True,
              help="Rows the text table shows; the rest are counted (--csv and --json print every row).")
def command(query: str, db_path: Path | None, as_json: bool, as_csv: bool, timeout_s: float, max_rows: int) -> None:
    """Run one read-only SQL query on the database and print its rows.

    The file is opened read-only, with PRAGMA query_only on; INSERT, UPDATE, DELETE, DROP, CREATE,
    ATTACH and pragmas that set a value are refused (exit 2). --json writes one object per row.
    Rows are streamed; Ctrl-C stops a running query (exit 130).
    """
    fmt = pick_format(as_json, as_csv)
    columns, rows = run_query(db_path or default_db_path(), query, timeout_s=timeout_s)
    write_rows(columns, rows, fmt, limit=max_rows if fmt == "text" else None)
