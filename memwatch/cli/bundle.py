"""``memwatch bundle RUN``: build a run's incident bundle by hand, as the sidecar does when a run ends badly."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..store import open_store
from .options import Text, db_option, json_option, run_argument

MIN_CAP_BYTES = 64 * 1024
"""Below this even an empty run's schema and accounts do not fit."""


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    from ..units import SizeError, parse_bytes

    try:
        size = parse_bytes(value)
    except SizeError as exc:
        raise click.BadParameter(str(exc)) from None
    if size < MIN_CAP_BYTES:
        raise click.BadParameter(f"{value} is under the smallest cap, {MIN_CAP_BYTES // 1024} KiB")
    return size


@click.command("bundle")
@run_argument
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Folder the bundle is written to (created if missing).")
@click.option("--max-bytes", "max_bytes", type=Text(max_length=64), default="64MiB", show_default=True,
              metavar="SIZE", callback=_size,
              help="Size cap (e.g. 64MiB, 200MB; at least 64KiB): over it, the full-resolution window is shortened "
                   "(roll-ups are kept), then the log tail is cut; the manifest says what went.")
@db_option
@json_option
def command(run: str, out_dir: Path, max_bytes: int, db_path: Path | None, as_json: bool) -> None:
    """Write a run's incident bundle: one checked .tar.gz every reading command opens with --db.

    RUN is a run id, a unique prefix or `latest`. The file is named
    memwatch-incident-<utc>-<pod or host>-<run>.tar.gz and appears only once complete.
    """
    from ..incident.bundle import build

    built = build(open_store(db_path, readonly=True), run, "manual", out_dir, cap_bytes=max_bytes)
    if as_json:
        click.echo(json.dumps({"path": str(built.path), "bytes": built.path.stat().st_size,
                               "seconds": round(built.seconds, 3), "manifest": built.manifest.to_dict()}))
        return
    dropped = f"; dropped to fit: {', '.join(built.manifest.dropped)}" if built.manifest.dropped else ""
    click.echo(f"{built.path} ({built.path.stat().st_size:,} bytes, run {built.manifest.run_id}, "
               f"{built.manifest.verdict}{dropped})")
