"""``memwatch attach PID``: a thin command over :mod:`memwatch.attach`."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import click
from click.core import ParameterSource

from ..attach import open_source, watch
from ..attach.record import RunRecorder
from ..attach.snapshot import Snapshot, Source
from ..attach.view import TREND_POINTS, render
from ..errors import UsageError
from ..hostinfo import ProcessExited
from .options import db_option, json_option


@click.command("attach")
@click.argument("pid", type=click.IntRange(min=1))
@click.option("--once", is_flag=True, help="Take one sample, print it and exit.")
@json_option
@click.option(
    "--interval", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
    help="Seconds between samples.",
)
@click.option(
    "--duration", type=click.FloatRange(min=0), default=None,
    help="Stop after this many seconds (default: when the process exits, or on Ctrl-C).",
)
@click.option("--record", is_flag=True, help="Also store the samples in the database as a run (source 'nvml').")
@db_option
def attach(
    pid: int, once: bool, as_json: bool, interval: float, duration: float | None, record: bool,
    db_path: Path | None,
) -> None:
    """Watch the GPU memory of the running process PID and its child processes.

    A process without the memwatch plugin is watched from outside: NVML gives the memory it holds on
    each GPU and each device's used, free and total bytes; psutil gives its command line, user, RSS
    and CPU. Watching stops when the process exits, after --duration, or on Ctrl-C.
    """
    if not record and click.get_current_context().get_parameter_source("db_path") is ParameterSource.COMMANDLINE:
        raise UsageError("--db only says where --record stores samples; add --record or drop --db")
    with closing(open_source(pid)) as source:
        recorder = RunRecorder(db_path) if record else None
        status = _run(source, recorder, once=once, as_json=as_json, interval=interval, duration=duration)
        if recorder is not None:
            recorder.finish(status)
            click.echo(f"recorded run {recorder.run_id}", err=True)


def _run(
    source: Source, recorder: RunRecorder | None, *, once: bool, as_json: bool, interval: float,
    duration: float | None,
) -> str:
    """Sample until done; the run status: ``exited`` (the process ended) or ``detached`` (we stopped)."""
    try:
        samples = watch(source, interval_s=interval, duration_s=duration)
        if once:
            samples = iter([next(samples)])
        if recorder is not None:
            samples = _recorded(samples, recorder)
        if as_json:
            for snapshot in samples:
                click.echo(json.dumps(snapshot.to_dict()))
        else:
            _show_live(samples)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a user stops watching; everything shown or recorded so far stays
    except ProcessExited as exited:
        click.echo(
            f"process {exited.pid} exited; its exit code is unknown (only its parent process can collect it)",
            err=True,
        )
        return "exited"
    return "detached"


def _recorded(samples: Iterator[Snapshot], recorder: RunRecorder) -> Iterator[Snapshot]:
    for snapshot in samples:
        recorder.add(snapshot)
        yield snapshot


def _show_live(samples: Iterator[Snapshot]) -> None:
    """Redraw the view in place on each sample; the last frame stays on screen."""
    from rich.live import Live

    history: deque[Snapshot] = deque(maxlen=TREND_POINTS)
    with Live(auto_refresh=False) as live:
        for snapshot in samples:
            history.append(snapshot)
            live.update(render(list(history)), refresh=True)


command = attach
"""The name the ``memwatch`` group registers commands under."""
