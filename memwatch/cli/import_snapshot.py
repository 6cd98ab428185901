"""``memwatch import-snapshot FILE --run RUN``: a PyTorch memory snapshot joined to a run as events."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..snapshot import import_snapshot
from ..store import open_store
from ..terminal import printable
from ..units import format_bytes
from .options import Text, db_option, int_range, json_option


@click.command("import-snapshot")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--run", "run", type=Text(), required=True,
              help="The run to join it to: an id, a unique prefix, or `latest`.")
@click.option("--rank", type=int_range(0), default=None,
              help="The rank it belongs to (default: the rank whose out-of-memory wrote it, else the first).")
@db_option
@json_option
def command(file: Path, run: str, rank: int | None, db_path: Path | None, as_json: bool) -> None:
    """Import a PyTorch memory snapshot into a recorded run as events.

    FILE is the pickle torch.cuda.memory._dump_snapshot writes.

    Adds events to the run: the largest live allocations with their top frames, the segments the
    allocator grew by, and the trace's out-of-memory entry (with the requested bytes and what CUDA
    still had free). The file is read with a loader that builds plain data only: nothing in it is
    executed. Importing the same file twice adds nothing the second time. The file must be a regular
    file (not a symlink, FIFO or device) of at most 256 MiB; it is read in a child process limited to
    60 s of CPU, 384 MiB of memory and 120 s in all, as the file's owner when run by root (nobody for
    root's own files). A snapshot takes about 5 times its size to load, so one over about 70 MB is
    refused for memory: record a shorter history (_record_memory_history's max_entries). The whole
    import stays under 512 MB. An entry holding a number out of range is set aside, and counted.
    """
    result = import_snapshot(open_store(db_path), run, file, rank=rank)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    if result.already_imported:
        click.echo(f"{file} was already imported into run {result.run_id} (rank {result.rank}); nothing added")
        return
    click.echo(printable(f"imported {file} into run {result.run_id} rank {result.rank}: {len(result.events)} events"))
    set_aside = result.events[0].data.get("set_aside", 0) if result.events else 0
    if set_aside:
        click.echo(f"  {set_aside} {'entry' if set_aside == 1 else 'entries'} set aside: a number in "
                   f"{'it' if set_aside == 1 else 'them'} was out of range")
    for event in result.events:
        data = event.data
        if event.kind == "snapshot_allocation":
            frame = (data.get("frames") or [{}])[0]
            where = f" at {frame.get('name')} ({frame.get('filename')}:{frame.get('line')})" if frame else ""
            click.echo(f"  live allocation #{data['place']}: {format_bytes(data['size_bytes'])}{printable(where)}")
        elif event.kind == "snapshot_segments":
            click.echo(f"  {data['segments']} segments, {format_bytes(data['reserved_bytes'])} reserved; the trace "
                       f"grew {data['segment_allocs']} segments ({format_bytes(data['segment_alloc_bytes'])}) and "
                       f"freed {data['segment_frees']} ({format_bytes(data['segment_free_bytes'])})")
        elif event.kind == "snapshot_oom":
            free = data.get("device_free_bytes")
            click.echo(f"  out of memory at step {event.step}: {format_bytes(data['requested_bytes'])} requested"
                       + ("" if free is None else f", {format_bytes(free)} free in CUDA"))
