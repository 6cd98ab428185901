"""``memwatch replay``: would this run have survived at another utilization, GPU, TP size or load?"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import click

from ..errors import UsageError
from ..plan.capacity import MAX_BLOCK_TOKENS
from ..units import TIB, SizeError, format_bytes, parse_bytes
from .options import RUN_REF, Text, db_option, finite_float, int_range, json_option

MAX_GPU_MEMORY = TIB
"""The largest device a replay simulates: 1 TiB, over three times the largest GPU made (288 GB). The simulator
keeps each KV block of the device as an object, so a device of 2**63 bytes took gigabytes and answered nothing."""
MIN_LOAD, MAX_LOAD = 1e-3, 1e3
"""``--load`` from a thousand times slower to a thousand times faster than recorded."""


def _bytes(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        size = parse_bytes(value)
    except SizeError as exc:
        raise UsageError(f"--gpu-memory: {exc}") from None
    if not 0 < size <= MAX_GPU_MEMORY:
        raise UsageError(f"--gpu-memory {value} is outside 1 byte to {format_bytes(MAX_GPU_MEMORY)}, the largest "
                         "device a replay simulates (over three times the largest GPU made)")
    return size


def _sweep(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """START, STOP and STEP are finite numbers (a NaN made every point "not a number" deep in the replay)."""
    if value is None:
        return None
    for part in value.partition("=")[2].split(":"):
        try:
            number = float(part)
        except ValueError:
            continue  # the replay's own parser names what is wrong
        if not math.isfinite(number):
            raise UsageError(f"--sweep {value!r}: START, STOP and STEP must be finite numbers, not {part.strip()}")
    return value


@click.command("replay")
@click.argument("run", type=RUN_REF)
@click.option("--utilization", type=finite_float(0, 1, low_open=True),
              help="gpu_memory_utilization for the replay (0 < U <= 1).")
@click.option("--gpu-memory", "gpu_memory", type=Text(), callback=_bytes, metavar="BYTES",
              help="Device size for the replay, in bytes or with a unit (80GiB); at most 1 TiB.")
@click.option("--tp", type=int_range(1), help="Tensor-parallel size for the replay.")
@click.option("--block-size", "block_size", type=int_range(1, MAX_BLOCK_TOKENS),
              help="KV block size in tokens (nano-vllm: a multiple of 256; vLLM: any above 0).")
@click.option("--max-num-seqs", "max_num_seqs", type=int_range(1), help="Most sequences per step.")
@click.option("--load", type=finite_float(MIN_LOAD, MAX_LOAD), default=1.0, show_default=True,
              help="Scale the arrival rate (2: the same requests arriving twice as fast), 0.001 to 1000.")
@click.option("--sweep", "sweep_spec", type=Text(), callback=_sweep, metavar="SETTING=START:STOP:STEP",
              help="Replay over a range of utilization or load and print the frontier (nothing is stored).")
@db_option
@json_option
def command(run: str, utilization: float | None, gpu_memory: int | None, tp: int | None, block_size: int | None,
            max_num_seqs: int | None, load: float, sweep_spec: str | None,
            db_path: Path | None, as_json: bool) -> None:
    """Replay a recorded run's workload and memory behaviour in the simulator under other settings.

    \b
    memwatch replay latest --utilization 0.95
    memwatch replay RUN --gpu-memory 80GiB --tp 2
    memwatch replay RUN --sweep utilization=0.8:0.95:0.01

    The replay is stored as a simulated run linked to the original (config replay_of); `check`,
    `explain` and `report` read it. A database that cannot be written (a read-only volume, an archive)
    is only read: the replay is compared and not kept. Exit 3 when the run recorded no request events
    (or there is no database), 2 for settings the engine cannot start with.
    """
    from ..replay import Settings, frontier, parse_sweep, replay_run, sweep
    from ..store.db import can_write, check_regular, default_db_path, held_in_memory, missing_database

    change = Settings(utilization=utilization, gpu_memory_bytes=gpu_memory, tp=tp, block_size=block_size,
                      max_num_seqs=max_num_seqs, load=load)
    db_path = db_path or default_db_path()
    check_regular(db_path)
    if not db_path.exists() and not held_in_memory(db_path):  # a bundle's database is held in memory
        raise missing_database(db_path)
    if sweep_spec is not None:
        name, values = parse_sweep(sweep_spec)
        recording, points = sweep(db_path, run, name, values, change)
        best = frontier(points)
        if as_json:
            click.echo(json.dumps({"original": recording.calibration.run_id, "setting": name,
                                   "frontier": None if best is None else best.value,
                                   "points": [point.to_dict() for point in points]}, indent=2))
            return
        from ..replay.text import render_sweep

        click.echo(render_sweep(recording, name, points, best))
        return
    kept = can_write(db_path)
    if kept:
        comparison = replay_run(db_path, run, change)
    else:
        with tempfile.TemporaryDirectory(prefix="memwatch-replay-") as scratch:
            comparison = replay_run(db_path, run, change, store_in=Path(scratch) / "replay.db")
        click.echo(f"note: {db_path} cannot be written, so the replay is compared here and not kept; to keep "
                   "it beside the run, copy the database to a writable place and pass --db", err=True)
    if as_json:
        data = comparison.to_dict()
        data["replay"]["stored"] = kept
        click.echo(json.dumps(data, indent=2))
        return
    from ..replay.text import render_calibration, render_comparison

    click.echo(render_calibration(comparison.recording.calibration))
    click.echo(render_comparison(comparison, change, kept=kept))
