"""Writing rows the same way everywhere: aligned text, JSON lines, or CSV with a header."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import click

from ..errors import UsageError
from ..losses import render_losses, run_losses
from ..store import Database
from ..terminal import printable

csv_option = click.option("--csv", "as_csv", is_flag=True, help="CSV with a header row.")


def pick_format(as_json: bool, as_csv: bool) -> str:
    if as_json and as_csv:
        raise UsageError("choose one of --json and --csv")
    return "json" if as_json else "csv" if as_csv else "text"


def write_rows(columns: Sequence[str], rows: Iterable[Sequence[Any]], fmt: str, *, empty: str = "(no rows)",
               limit: int | None = None) -> int:
    """Write ``rows`` as JSON lines (one object per row), CSV, or a text table; returns how many.

    JSON and CSV stream every row. The table must see its rows to align them, so with ``limit`` it keeps
    only that many and ends with a note counting the rest.
    """
    count = 0
    out = sys.stdout
    if fmt == "json":
        for row in rows:
            out.write(json.dumps(dict(zip(columns, row, strict=True)), default=str) + "\n")
            count += 1
        return count
    if fmt == "csv":
        writer = csv.writer(out)
        writer.writerow(columns)
        for row in rows:
            writer.writerow(row)
            count += 1
        return count
    buffered: list[list[str]] = []
    more = 0
    for row in rows:
        if limit is not None and len(buffered) >= limit:
            more += 1
            continue
        buffered.append(["" if value is None else str(value) for value in row])
    widths = [max([len(column), *(len(row[i]) for row in buffered)]) for i, column in enumerate(columns)]
    out.write("  ".join(column.ljust(width) for column, width in zip(columns, widths, strict=True)).rstrip() + "\n")
    for row in buffered:
        out.write("  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip() + "\n")
    if not buffered:
        out.write(empty + "\n")
    if more:
        out.write(f"({more:,} more row{'s' if more > 1 else ''} not shown: the table stops at {limit:,}; "
                  "--csv or --json print every row)\n")
    return len(buffered) + more


def where_kinds_rank(sql: str, params: list[Any], kinds: Sequence[str], rank: int | None) -> str:
    """``sql`` narrowed to the given kinds (any, when none) and rank; appends their parameters."""
    if kinds:
        sql += f" AND kind IN ({', '.join('?' * len(kinds))})"
        params.extend(kinds)
    if rank is not None:
        sql += " AND rank = ?"
        params.append(rank)
    return sql


def echo_report(db: Database, run_id: str, started_ns: int | None, data: dict[str, Any], text: str,
                as_json: bool) -> None:
    """A post-mortem report with the run's lost samples: JSON, or text with control characters escaped.

    The text carries names and messages that came from engines and processes, so every line goes
    through :func:`printable`; JSON needs no escaping.
    """
    losses = run_losses(db, run_id)
    if as_json:
        click.echo(json.dumps({**data, "lost_samples": losses.to_dict()}, indent=2))
        return
    lines = [*text.split("\n"), *render_losses(losses, started_ns)]
    click.echo("\n".join(printable(line) for line in lines))
