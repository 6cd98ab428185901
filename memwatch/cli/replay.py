"""``memwatch replay``: would this run have survived at another utilization, GPU, TP size or load?"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import UsageError
from ..units import SizeError, parse_bytes
from .options import db_option, json_option


def _bytes(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except SizeError as exc:
        raise UsageError(f"--gpu-memory: {exc}") from None


@click.command("replay")
@click.argument("run")
@click.option("--utilization", type=float, help="gpu_memory_utilization for the replay (0 < U <= 1).")
@click.option("--gpu-memory", "gpu_memory", callback=_bytes, metavar="BYTES",
              help="Device size for the replay, in bytes or with a unit (80GiB).")
@click.option("--tp", type=int, help="Tensor-parallel size for the replay.")
@click.option("--block-size", "block_size", type=int,
              help="KV block size in tokens (nano-vllm: a multiple of 256; vLLM: any above 0).")
@click.option("--max-num-seqs", "max_num_seqs", type=int, help="Most sequences per step.")
@click.option("--load", type=float, default=1.0, show_default=True,
              help="Scale the arrival rate (2: the same requests arriving twice as fast).")
@click.option("--sweep", "sweep_spec", metavar="SETTING=START:STOP:STEP",
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
    `explain` and `report` read it. Exit 3 when the run recorded no request events, 2 for settings the
    engine cannot start with.
    """
    from ..replay import Settings, frontier, parse_sweep, replay_run, sweep
    from ..store.db import default_db_path

    if load <= 0:
        raise UsageError(f"--load must be positive, got {load}")
    change = Settings(utilization=utilization, gpu_memory_bytes=gpu_memory, tp=tp, block_size=block_size,
                      max_num_seqs=max_num_seqs, load=load)
    db_path = db_path or default_db_path()
    if not db_path.exists():
        raise UsageError(f"no database at {db_path}; record a run first (memwatch demo) or pass --db")
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
    comparison = replay_run(db_path, run, change)
    if as_json:
        click.echo(json.dumps(comparison.to_dict(), indent=2))
        return
    from ..replay.text import render_calibration, render_comparison

    click.echo(render_calibration(comparison.recording.calibration))
    click.echo(render_comparison(comparison, change))
