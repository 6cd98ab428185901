"""``memwatch incidents URL``: the bundles under a folder or object-store prefix, newest first, each by its manifest."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import click

from ..errors import StoreError
from .options import Text, int_range, json_option

if TYPE_CHECKING:
    from ..incident.listing import Listed


@click.command("incidents")
@click.argument("url", type=Text(max_length=4096))
@click.option("--limit", type=int_range(1, 10_000), default=100, show_default=True,
              help="List only the newest this many (by name; each costs one small read of its manifest).")
@json_option
def command(url: str, limit: int, as_json: bool) -> None:
    """List the incident bundles under a folder or URL, newest first, each by its manifest.

    URL is a folder or a file://, s3://, gs:// or az:// prefix. Only each bundle's manifest is read (the start of
    the file) and checked; an entry that is no bundle, or whose manifest fails, is listed as REFUSED and the
    command exits 6. A bundle's members are checked when it is opened, with any reading command:
    memwatch explain latest --db URL/NAME.
    """
    from ..incident.listing import list_bundles

    listed = list_bundles(url, limit)
    for line in _lines(url, listed, as_json):
        click.echo(line)
    _refused(url, listed)


def _lines(url: str, listed: list[Listed], as_json: bool) -> list[str]:
    """What the command prints: one JSON object a bundle, or a table of them (a plain function, not click's
    command, so that mutation testing reaches it)."""
    if as_json:
        return [json.dumps(item.to_dict()) for item in listed]
    rows = [("TIME (UTC)", "POD/HOST", "MODEL", "VERDICT", "RUN", "BUNDLE")]
    for item in listed:
        d = item.to_dict()
        when = "-" if d["created_ns"] is None else time.strftime("%Y-%m-%d %H:%M:%S",
                                                                   time.gmtime(int(d["created_ns"]) // 10**9))
        rows.append((when, str(d["pod"] or "-"), str(d["model"] or "-"),
                     str(d["verdict"]) if item.manifest else f"REFUSED: {item.error}", str(d["run_id"] or "-"),
                     item.uri.rsplit("/", 1)[-1]))
    if len(rows) == 1:
        return [f"no bundles under {url}"]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return ["  ".join([*(row[i].ljust(widths[i]) for i in range(5)), row[5]]) for row in rows]


def _refused(url: str, listed: list[Listed]) -> None:
    """Exit 6 when any entry was refused, saying how many of how many."""
    refused = sum(item.manifest is None for item in listed)
    if refused:
        raise StoreError(f"{refused} of {len(listed)} entries under {url} were refused (not a bundle, or its "
                         "manifest failed its checks)")
