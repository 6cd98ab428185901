"""``memwatch flags RUN``: the flags the sidecar raised for a run, filtered by kind, rank and severity."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..flags import FLAG_KINDS, SEVERITIES
from ..store import open_store
from ..store.queries import get_run
from .options import db_option, int_range, json_option, run_argument
from .output import csv_option, pick_format, where_kinds_rank, write_rows

COLUMNS = ("run_id", "rank", "step", "ts_ns", "kind", "severity", "message", "data")


@click.command("flags")
@run_argument
@db_option
@json_option
@csv_option
@click.option("--kind", "kinds", multiple=True, type=click.Choice(FLAG_KINDS), help="Only this kind (repeatable).")
@click.option("--rank", type=int_range(0), default=None, help="Only this rank.")
@click.option("--severity", type=click.Choice(SEVERITIES), default=None, help="Only this severity or worse.")
def command(run: str, db_path: Path | None, as_json: bool, as_csv: bool, kinds: tuple[str, ...],
            rank: int | None, severity: str | None) -> None:
    """List the flags stored for a run, in time order. RUN is a run id, a unique prefix, or `latest`.

    These are the flags the sidecar raised live (`memwatch check` also replays the detectors when
    asked for other thresholds). --json writes one object per flag per line, its `data` decoded.
    """
    fmt = pick_format(as_json, as_csv)
    db = open_store(db_path, readonly=True)
    info = get_run(db, run)
    sql, params = f"SELECT {', '.join(COLUMNS)} FROM flags WHERE run_id = ?", [info.run_id]
    sql = where_kinds_rank(sql, params, kinds, rank)
    if severity is not None:
        allowed = SEVERITIES[SEVERITIES.index(severity):]
        sql += f" AND severity IN ({', '.join('?' * len(allowed))})"
        params.extend(allowed)
    rows = db.execute(sql + " ORDER BY ts_ns, rank, rowid", params)
    if fmt == "json":
        rows = ((*row[:7], json.loads(row[7] or "{}")) for row in rows)
    elif fmt == "text":
        start = info.started_ns or 0
        rows = ((f"{(row[3] - start) / 1e9:.3f}", row[1], row[2], row[5], row[4], row[6]) for row in rows)
        write_rows(("T+s", "rank", "step", "severity", "kind", "message"), rows, fmt, empty="(no flags match)")
        return
    write_rows(COLUMNS, rows, fmt)
