"""``memwatch timeline RUN``: the samples of a run, or a window of it, as a table, JSON lines or CSV."""

from __future__ import annotations

import csv
import json
import sys
from collections import deque
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

import click

from ..errors import NotFoundError, UsageError
from ..ledger import Ledger, LedgerTerms
from ..losses import Gap, run_losses, span
from ..records import SAMPLE_COLUMNS, Event, Sample
from ..store import open_store
from ..store.db import Database
from ..store.moments import find_moment, parse_duration_ns, resolve_time
from ..store.queries import Run
from ..store.run_figures import RunTruth
from ..store.run_model import StoredRun, load_run
from ..store.sql_text import ENGINE_LINE, NVML_LINE, timed_line_sql
from ..store.window import WindowRow
from ..store.window_text import window_text
from ..terminal import printable
from ..units import format_bytes, format_offset_s
from .options import Text, db_option, int_range, json_option, run_argument

__all__ = ["command", "parse_duration_ns"]

LEDGER_COLUMNS: tuple[str, ...] = LedgerTerms._fields


MAX_STEP = (1 << 63) - 1


def _moment(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``step:N`` with N a step the store can hold (0 up to 2**63 - 1); other moments are read by the store."""
    if value is not None and value.strip().startswith("step:"):
        number = value.strip()[5:].strip()
        if number.lstrip("-").isdigit() and not 0 <= int(number[:30]) <= MAX_STEP:
            raise UsageError(f"--around {value[:40]}: a step is 0 up to {MAX_STEP:,}")
    return value


@click.command("timeline")
@run_argument
@db_option
@json_option
@click.option("--csv", "as_csv", is_flag=True, help="CSV with a header row.")
@click.option("--rank", type=int_range(0), default=None, help="Only this rank.")
@click.option("--last", "last", type=Text(), default=None, help="Only the last part of the run, e.g. 60s or 5m.")
@click.option("--since", type=Text(), default=None,
              help="From this time: +90s (after the start), -5m (before the end), or ISO.")
@click.option("--until", type=Text(), default=None, help="Up to this time, written as for --since.")
@click.option("--around", type=Text(), callback=_moment, default=None,
              help="Centre the window on oom, a flag kind (its first flag), or step:N.")
@click.option("--window", "window", type=Text(), default="60s", show_default=True,
              help="The window's width with --around.")
@click.option("--ledger", is_flag=True, help="Add the ledger terms of every sample as columns.")
@click.option("--jobs", type=click.Choice(["auto", "1", "2"]), default="auto", show_default=True,
              help="Processes that read a table of 2 s or more: 2 reads its later half in a second process; "
                   "auto does so only while a CPU is idle for it.")
def command(run: str, db_path: Path | None, as_json: bool, as_csv: bool, rank: int | None, last: str | None,
            since: str | None, until: str | None, around: str | None, window: str, ledger: bool, jobs: str) -> None:
    """Show a run's samples in time order. RUN is a run id, a unique prefix, or `latest`.

    --json writes one JSON object per sample per line, keyed by the `samples` column names (plus the
    ledger terms with --ledger; a second rolled up by retention also carries `rolled_up`: its sample
    count and the min and max of each column).
    """
    if as_json and as_csv:
        raise UsageError("choose one of --json and --csv")
    if around is not None and (since or until or last):
        raise UsageError("--around sets the window itself; drop --since, --until and --last")
    db = open_store(db_path, readonly=True)
    model = load_run(db, run)
    info = model.run
    if rank is not None:
        _require_rank(model, rank)
    since_ns = until_ns = None
    if last is not None:
        end = model.time_span()[1]
        since_ns = None if end is None else end - parse_duration_ns(last)
    if since is not None:
        since_ns = resolve_time(db, info, since)
    if until is not None:
        until_ns = resolve_time(db, info, until)
    if around is not None:
        centre, half = find_moment(db, info, around, rank), parse_duration_ns(window) // 2
        since_ns, until_ns = centre - half, centre + half
    since_ns, until_ns = _in_range(since_ns), _in_range(until_ns)  # a window around a stored extreme overflows
    if not (as_json or as_csv or ledger) and _write_lines(db, info, rank, since_ns, until_ns,
                                                         None if jobs == "auto" else int(jobs)):
        return
    rows = model.window(rank, since_ns, until_ns)
    with_terms = _with_ledger(model, rows, rank) if ledger else ((row, None) for row in rows)
    if as_json:
        _write_json(with_terms)
    elif as_csv:
        _write_csv(with_terms, ledger)
    else:
        _write_table(info, with_terms, ledger, _gaps(db, info, rank))


def _in_range(ns: int | None) -> int | None:
    """``ns`` within SQLite's integers."""
    return None if ns is None else min(max(ns, -(1 << 63)), (1 << 63) - 1)


def _gaps(db: Database, info: Run, rank: int | None) -> list[Gap]:
    return [gap for gap in run_losses(db, info.run_id).gaps if rank is None or gap.rank == rank]


def _require_rank(model: StoredRun, rank: int) -> None:
    """A rank the run never had is not found, rather than an empty window."""
    ranks = sorted(row["rank"] for row in model.rank_rows)
    if ranks and rank not in ranks:
        have = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        raise NotFoundError(f"run {model.run_id} has no rank {rank} (it has {have}); drop --rank or pick one of those")


def _with_ledger(
    model: StoredRun, rows: Iterator[WindowRow], rank: int | None
) -> Iterator[tuple[WindowRow, LedgerTerms]]:
    """Each row with its ledger terms; the run's events (the sizing) go in before the samples they precede."""
    from ..detectors import interleave

    ledgers: dict[int, Ledger] = {}
    pending: deque[WindowRow] = deque()
    truth, ends = _truth(model)

    def samples() -> Iterator[Sample]:
        for row in rows:
            pending.append(row)
            yield row.sample

    for record in interleave(samples(), model.events if rank is None else model.rank_events(rank)):
        book = ledgers.setdefault(record.rank, Ledger())
        if isinstance(record, Event):
            book.on_event(record)
        else:
            terms = book.on_sample(record)
            end = truth.rank(record.rank)
            if end is not None and ends.get(record.rank) == record.ts_ns:  # the margin at the end, as shared
                terms = terms._replace(oom_margin_bytes=end.oom_margin_bytes)
            yield pending.popleft(), terms


def _truth(model: StoredRun) -> tuple[RunTruth, dict[int, int]]:
    """The run's shared quantities and each rank's last sample time: the last row carries the margin at the end."""
    ends = {rank: tail[-1].ts_ns for rank, tail in model.tails.items() if tail}
    return model.figures, ends


def _write_json(rows: Iterator[tuple[WindowRow, LedgerTerms | None]]) -> None:
    for row, terms in rows:
        record = row.sample._asdict()
        if terms is not None:
            record.update(terms._asdict())
        if row.rollup is not None:
            record["rolled_up"] = row.rollup._asdict()
        sys.stdout.write(json.dumps(record) + "\n")


def _write_csv(rows: Iterator[tuple[WindowRow, LedgerTerms | None]], ledger: bool) -> None:
    writer = csv.writer(sys.stdout)
    writer.writerow((*SAMPLE_COLUMNS, *LEDGER_COLUMNS) if ledger else SAMPLE_COLUMNS)
    for row, terms in rows:
        writer.writerow((*row.sample, *terms) if terms is not None else row.sample)


def _header(info: Run, ledger: bool) -> bool:
    """Print the run's line and the column titles; whether the run was seen from outside, through NVML."""
    click.echo(f"run {info.run_id}  {printable(info.engine or '-')}  {printable(info.model or '-')}  "
               f"status {info.status}")
    nvml = info.source == "nvml"  # seen from outside: the process's NVML bytes instead of the allocator's view
    if nvml:
        header = f"{'T+s':>8} {'GPU':>4} {'SAMPLE':>7} {'PROCESS':>10} {'DRV USED':>10} {'DRV FREE':>10}"
    else:
        header = (f"{'T+s':>8} {'RANK':>4} {'STEP':>7} {'PHASE':<9} {'KIND':<7} {'ALLOCATED':>10} {'RESERVED':>10} "
                  f"{'PEAK':>10} {'DRV USED':>10} {'DRV FREE':>10} {'KV':>11}")
        if ledger:
            header += f" {'NON-TORCH':>10} {'SLACK':>10} {'HEADROOM':>10} {'OOM MARGIN':>10}"
    click.echo(header)
    return nvml


def _write_lines(db: Database, info: Run, rank: int | None, since_ns: int | None, until_ns: int | None,
                 jobs: int | None) -> bool:
    """:func:`_write_table` without ledger terms, every line computed by SQLite: the same text. False (nothing
    written) when the window holds rolled-up seconds, which only :func:`_write_table` shows."""
    start = info.started_ns or 0
    line_sql = timed_line_sql(NVML_LINE if info.source == "nvml" else ENGINE_LINE, start)
    notes = [(gap.to_ts_ns or 0, f"{'--':>8} rank {gap.rank}: {gap.count:,} samples lost here {span(gap, start)}")
             for gap in _gaps(db, info, rank)]
    window = window_text(db, info.run_id, line_sql, rank=rank, since_ns=since_ns, until_ns=until_ns, notes=notes,
                         repeats=lambda shown, sample: _repeats((shown, None), sample, None))
    if window is None:
        return False
    db.conn.close()  # reading may fork, and no SQLite connection may be carried across a fork
    text = window.read(jobs)
    _header(info, False)  # pragma: no mutate (None and False alike: no ledger columns)
    if text:  # a note shows only before a sample: the text holds a sample whenever it holds anything
        sys.stdout.write(text)
    else:
        click.echo("(no samples in that window)")
    return True


def _write_table(info: Run, rows: Iterator[tuple[WindowRow, LedgerTerms | None]], ledger: bool,
                 gaps: list[Gap]) -> None:
    """The samples as a table; a line marks each gap where samples were lost, before the first sample after it."""
    start = info.started_ns or 0
    nvml = _header(info, ledger)
    written = False
    # A window repeats the same few values many times; the cache's size changes no text.
    size = lru_cache(maxsize=8192)(format_bytes)  # pragma: no mutate
    write = sys.stdout.write
    previous: tuple[Sample, LedgerTerms | None] | None = None
    for row, terms in rows:
        while gaps and (gaps[0].to_ts_ns or 0) <= row.sample.ts_ns:
            gap = gaps.pop(0)
            write(f"{'--':>8} rank {gap.rank}: {gap.count:,} samples lost here {span(gap, start)}\n")
        if row.rollup is None and previous is not None and _repeats(previous, row.sample, terms):
            continue  # a phase boundary: the readings that ended one phase, recorded again to open or close one
        previous = (row.sample, terms)
        line = _nvml_line(row, start, size) if nvml else _engine_line(row, start, size)
        if terms is not None and not nvml:
            line += "".join(f" {size(value):>10}" for value in (
                terms.non_torch_bytes, terms.cache_slack_bytes, terms.headroom_bytes, terms.oom_margin_bytes))
        if row.rollup is not None:
            line += f"  (1 s: {row.rollup.samples} samples)"
        write(line + "\n")
        written = True
    if not written:
        click.echo("(no samples in that window)")


_LABELS = frozenset({"phase", "step_kind", "peak_is_step"})  # what a row is called, not what it read


def _repeats(previous: tuple[Sample, LedgerTerms | None], sample: Sample, terms: LedgerTerms | None) -> bool:
    """Whether ``sample`` says nothing new: the same moment, readings and ledger terms, give or take its labels and
    blanks (a boundary's repeat has no step of its own, so no step activation either)."""
    before, before_terms = previous
    # Every row of one table has its ledger terms, or none has; a tuple's fields pair up one for one.
    said = zip(terms or (), before_terms or (), strict=True)  # pragma: no mutate
    if not all(value is None or value == old for value, old in said):
        return False
    readings = zip(sample._fields, sample, before, strict=True)  # pragma: no mutate
    return all(value is None or value == old or name in _LABELS for name, value, old in readings)


def _engine_line(row: WindowRow, start: int, size: Callable[[int | None], str]) -> str:
    s = row.sample
    kv = f"{s.kv_blocks_used}/{s.kv_blocks_total}" if s.kv_blocks_total is not None else "-"
    return (
        f"{format_offset_s(s.ts_ns - start):>8} {s.rank:>4} {s.step:>7} {s.phase or '-':<9} {s.step_kind or '-':<7} "
        f"{size(s.allocated_bytes):>10} {size(s.reserved_bytes):>10} {size(s.peak_bytes):>10} "
        f"{size(s.driver_used_bytes):>10} {size(s.driver_free_bytes):>10} {kv:>11}"
    )


def _nvml_line(row: WindowRow, start: int, size: Callable[[int | None], str]) -> str:
    s = row.sample
    return (
        f"{format_offset_s(s.ts_ns - start):>8} {s.rank:>4} {s.step:>7} {size(s.process_used_bytes):>10} "
        f"{size(s.driver_used_bytes):>10} {size(s.driver_free_bytes):>10}"
    )
