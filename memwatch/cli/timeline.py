"""``memwatch timeline RUN``: the samples of a run as a table, JSON lines or CSV."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import click

from ..errors import UsageError
from ..records import SAMPLE_COLUMNS, Sample
from ..store import open_store
from ..store.queries import get_run, last_ts_ns, samples
from ..units import format_bytes
from .options import db_option, json_option

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SCALE = {"ms": 1e6, "s": 1e9, None: 1e9, "m": 60e9, "h": 3600e9}


def parse_duration_ns(text: str) -> int:
    """``60s``, ``5m``, ``1.5h``, ``250ms`` or a bare number of seconds, in nanoseconds."""
    match = _DURATION.match(text)
    if not match:
        raise UsageError(f"cannot read duration {text!r}; write e.g. 60s, 5m, 1h or 250ms")
    return int(float(match.group(1)) * _SCALE[match.group(2)])


@click.command("timeline")
@click.argument("run")
@db_option
@json_option
@click.option("--csv", "as_csv", is_flag=True, help="CSV with a header row.")
@click.option("--rank", type=int, default=None, help="Only this rank.")
@click.option("--last", "last", default=None, help="Only the last part of the run, e.g. 60s or 5m.")
def command(run: str, db_path: Path | None, as_json: bool, as_csv: bool, rank: int | None, last: str | None) -> None:
    """Show a run's samples in time order. RUN is a run id, a unique prefix, or `latest`.

    --json writes one JSON object per sample per line, keyed by the `samples` column names.
    """
    if as_json and as_csv:
        raise UsageError("choose one of --json and --csv")
    db = open_store(db_path, readonly=True)
    info = get_run(db, run)
    since = None
    if last is not None:
        end = last_ts_ns(db, info.run_id)
        since = None if end is None else end - parse_duration_ns(last)
    rows = samples(db, info.run_id, rank=rank, since_ns=since)
    if as_json:
        for sample in rows:
            sys.stdout.write(json.dumps(sample._asdict()) + "\n")
        return
    if as_csv:
        writer = csv.writer(sys.stdout)
        writer.writerow(SAMPLE_COLUMNS)
        writer.writerows(rows)
        return
    start = info.started_ns or 0
    click.echo(f"run {info.run_id}  {info.engine or '-'}  {info.model or '-'}  status {info.status}")
    if info.source == "nvml":  # seen from outside: the process's NVML bytes instead of the allocator's view
        header = f"{'T+s':>8} {'GPU':>4} {'SAMPLE':>7} {'PROCESS':>10} {'DRV USED':>10} {'DRV FREE':>10}"
    else:
        header = (f"{'T+s':>8} {'RANK':>4} {'STEP':>7} {'PHASE':<9} {'KIND':<7} {'ALLOCATED':>10} {'RESERVED':>10} "
                  f"{'PEAK':>10} {'DRV USED':>10} {'DRV FREE':>10} {'KV':>11}")
    click.echo(header)
    count = 0
    for s in rows:
        click.echo(_nvml_line(s, start) if info.source == "nvml" else _engine_line(s, start))
        count += 1
    if count == 0:
        click.echo("(no samples in that window)")


def _engine_line(s: Sample, start: int) -> str:
    kv = f"{s.kv_blocks_used}/{s.kv_blocks_total}" if s.kv_blocks_total is not None else "-"
    return (
        f"{(s.ts_ns - start) / 1e9:>8.3f} {s.rank:>4} {s.step:>7} {s.phase or '-':<9} {s.step_kind or '-':<7} "
        f"{format_bytes(s.allocated_bytes):>10} {format_bytes(s.reserved_bytes):>10} "
        f"{format_bytes(s.peak_bytes):>10} {format_bytes(s.driver_used_bytes):>10} "
        f"{format_bytes(s.driver_free_bytes):>10} {kv:>11}"
    )


def _nvml_line(s: Sample, start: int) -> str:
    return (
        f"{(s.ts_ns - start) / 1e9:>8.3f} {s.rank:>4} {s.step:>7} {format_bytes(s.process_used_bytes):>10} "
        f"{format_bytes(s.driver_used_bytes):>10} {format_bytes(s.driver_free_bytes):>10}"
    )
