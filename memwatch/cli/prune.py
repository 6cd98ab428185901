"""``memwatch prune``: apply retention by hand (roll old samples up, keep the evidence) and reclaim space."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import click

from ..store import default_db_path, open_store
from ..store.db import store_error
from ..store.moments import parse_duration_ns
from ..store.queries import get_run
from ..store.retention import DEFAULT_EVIDENCE_NS, DEFAULT_FULL_NS, Retention, apply_retention
from .options import RUN_REF, Text, db_option, json_option

_READ_ONLY_CODES = frozenset({sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM, sqlite3.SQLITE_CANTOPEN,
                              sqlite3.SQLITE_AUTH})


def _cannot_write(exc: sqlite3.DatabaseError) -> bool:
    """SQLite refused a write because the file (or its folder, or its mount) is read-only: the database is fine.

    SQLite opens a database for writing even where it can only read when its ``-wal`` and ``-shm`` are there;
    the refusal comes with the first write, extended codes included (``SQLITE_READONLY_*``)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in _READ_ONLY_CODES


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())


@click.command("prune")
@db_option
@json_option
@click.option("--keep-full", type=Text(), default=f"{DEFAULT_FULL_NS // 10**9}s", show_default=True,
              help="Keep this much of the end of every run at full resolution.")
@click.option("--keep-evidence", type=Text(), default=f"{DEFAULT_EVIDENCE_NS // 10**9}s", show_default=True,
              help="Keep this much either side of every flag and OOM at full resolution.")
@click.option("--run", "runs", multiple=True, type=RUN_REF, help="Only this run (repeatable); default all.")
@click.option("--no-vacuum", is_flag=True, help="Do not rewrite the file to give the freed space back.")
def command(db_path: Path | None, as_json: bool, keep_full: str, keep_evidence: str, runs: tuple[str, ...],
            no_vacuum: bool) -> None:
    """Roll samples older than --keep-full up per second per rank, keep the evidence, reclaim space.

    The sidecar does the same as it runs; this applies it now, to every run or those named, with the
    windows given, then VACUUMs the file (unless --no-vacuum).
    """
    retention = Retention(parse_duration_ns(keep_full), parse_duration_ns(keep_evidence))
    path = db_path or default_db_path()
    db = open_store(path, readonly=True)
    run_ids = [get_run(db, ref).run_id for ref in runs] or None
    db.conn.close()
    before = _size(path)
    db = open_store(path)
    try:
        result = apply_retention(db, retention, run_ids)
        vacuumed = False
        if not no_vacuum:
            try:
                db.conn.execute("VACUUM")
                db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                vacuumed = True
            except sqlite3.OperationalError as exc:  # a sidecar writing: the freed pages are reused instead
                if _cannot_write(exc):
                    raise
                click.echo(f"memwatch prune: space not given back now ({exc}); the freed pages will be reused",
                           err=True)
    except sqlite3.DatabaseError as exc:
        if _cannot_write(exc):
            raise store_error(path, exc) from None  # read-only, not damaged: exit 5, never "move it aside"
        raise
    finally:
        db.conn.close()
    after = _size(path)
    report = {"runs": result.runs, "rolled_samples": result.rolled_samples, "bytes_before": before,
              "bytes_after": after, "vacuumed": vacuumed}
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"rolled {result.rolled_samples:,} samples of {result.runs} run(s) up into per-second rows; "
               f"{before / 2**20:,.1f} MiB -> {after / 2**20:,.1f} MiB")
