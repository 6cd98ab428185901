"""``memwatch events RUN``: what happened once in a run (phases, KV sizing, preemptions, the OOM)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..store import open_store
from ..store.queries import get_run
from .options import Text, db_option, int_range, json_option, run_argument
from .output import csv_option, pick_format, where_kinds_rank, write_rows

COLUMNS = ("run_id", "rank", "step", "ts_ns", "kind", "data")


@click.command("events")
@run_argument
@db_option
@json_option
@csv_option
@click.option("--kind", "kinds", multiple=True, type=Text(),
              help="Only this kind (repeat for several), e.g. oom, kv_allocated.")
@click.option("--rank", type=int_range(0), default=None, help="Only this rank.")
def command(run: str, db_path: Path | None, as_json: bool, as_csv: bool, kinds: tuple[str, ...],
            rank: int | None) -> None:
    """List a run's events in time order. RUN is a run id, a unique prefix, or `latest`.

    --json writes one object per event per line (its `data` decoded); --csv writes `data` as JSON text.
    """
    fmt = pick_format(as_json, as_csv)
    db = open_store(db_path, readonly=True)
    info = get_run(db, run)
    sql, params = "SELECT run_id, rank, step, ts_ns, kind, data FROM events WHERE run_id = ?", [info.run_id]
    sql = where_kinds_rank(sql, params, kinds, rank)
    rows = db.execute(sql + " ORDER BY ts_ns, rank, rowid", params)
    if fmt == "json":
        rows = ((*row[:5], json.loads(row[5] or "{}")) for row in rows)
    elif fmt == "text":
        start = info.started_ns or 0
        rows = ((f"{(row[3] - start) / 1e9:.3f}", row[1], row[2], row[4], row[5]) for row in rows)
        write_rows(("T+s", "rank", "step", "kind", "data"), rows, fmt, empty="(no events match)")
        return
    write_rows(COLUMNS, rows, fmt)
