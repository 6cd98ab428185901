"""``memwatch attach PID``: a thin command over :mod:`memwatch.attach`."""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import click
from click.core import ParameterSource

from ..attach import open_source, watch
from ..attach.hostinfo import ProcessExited
from ..attach.inject_checks import check_all, inject_hint
from ..attach.record import RunRecorder
from ..attach.snapshot import Snapshot, Source
from ..attach.view import TREND_POINTS, render
from ..errors import UsageError
from ..terminal import printable
from .options import Seconds, db_option, json_option


@click.command("attach")
@click.argument("pid", type=click.IntRange(min=1))
@click.option("--once", is_flag=True, help="Take one sample, print it and exit.")
@json_option
@click.option(
    "--interval", type=Seconds(0, 86400.0, low_open=True), default=1.0, show_default=True,
    help="Seconds between samples.",
)
@click.option(
    "--duration", type=Seconds(0), default=None,
    help="Stop after this many seconds (default: when the process exits, or on Ctrl-C).",
)
@click.option("--record", is_flag=True, help="Also store the samples in the database as a run (source 'nvml').")
@click.option("--inject", is_flag=True,
              help="Record every step inside PID, a Python engine started without memwatch (pauses it briefly).")
@click.option("--detach", "detach_", is_flag=True, help="Undo --inject in PID: original methods back, recording stops.")
@click.option("--inject-timeout", type=Seconds(0, 3600.0, low_open=True), default=20.0, show_default=True,
              help="Seconds --inject and --detach wait for the process before giving up (it is left as it was).")
@db_option
def attach(
    pid: int, once: bool, as_json: bool, interval: float, duration: float | None, record: bool,
    inject: bool, detach_: bool, inject_timeout: float, db_path: Path | None,
) -> None:
    """Watch the GPU memory of the running process PID and its child processes.

    A process without the memwatch plugin is watched from outside: NVML gives the memory it holds on
    each GPU and each device's used, free and total bytes; psutil gives its command line, user, RSS
    and CPU. Watching stops when the process exits, after --duration, or on Ctrl-C.

    --inject turns on memwatch's per-step recording inside a Python engine that was started without
    it, without restarting it; --detach turns it off again.
    """
    if inject and detach_:
        raise UsageError("--inject and --detach contradict each other; pass one of them")
    # Every option is checked before anything is done to the process.
    if not record and click.get_current_context().get_parameter_source("db_path") is ParameterSource.COMMANDLINE:
        raise UsageError("--db only says where --record stores samples; add --record or drop --db")
    if detach_:
        from ..attach.inject import detach

        pids = detach(pid, timeout_s=inject_timeout)
        click.echo(f"memwatch detached from process {', '.join(map(str, pids))}: the engine's own methods are "
                   "back and the recording stopped; the run ends 'detached'", err=True)
        return
    if inject:
        _inject(pid, interval, inject_timeout)
    else:
        _hint(pid)
    with closing(open_source(pid)) as source:
        _whose_ring(pid, source)
        recorder = RunRecorder(db_path) if record else None
        status = _run(source, recorder, once=once, as_json=as_json, interval=interval, duration=duration)
        if recorder is not None:
            recorder.finish(status)
            click.echo(f"recorded run {recorder.run_id}", err=True)


def _inject(pid: int, interval: float, timeout_s: float) -> None:
    from memwatch_engine.runtime import ensure_runtime_dir
    from memwatch_engine.spawn import ensure_sidecar

    from ..attach.inject import inject

    check_all(pid)  # refusals come before anything is started
    directory = ensure_runtime_dir()
    if os.environ.get("MEMWATCH_SPAWN", "1") != "0":
        ensure_sidecar(directory)
    done = inject(pid, interval_s=interval, timeout_s=timeout_s)
    for warning in dict.fromkeys(done.warnings):
        click.echo(f"warning: inside process {pid}: {warning}", err=True)
    if done.already:
        click.echo(f"process {pid} is already recorded by memwatch; nothing injected", err=True)
    elif done.engine is None:
        click.echo(f"process {pid} has nothing for memwatch to record; nothing was left running in it", err=True)
    else:
        how = "a sampler thread" if done.engine == "python" else f"the {done.engine} adapter"
        click.echo(f"memwatch runs inside process {', '.join(map(str, done.pids))} ({how}, run {done.run_id}); "
                   f"undo with: memwatch attach --detach {pid}", err=True)


def _whose_ring(pid: int, source: Source) -> None:
    """Rings found under a descendant of PID, not PID itself: say whose they are."""
    writers = getattr(source, "writer_pids", [pid])
    if pid in writers:
        return
    what = ", ".join(part for part in (getattr(source, "engine", None), getattr(source, "model", None)) if part)
    plural = "es" if len(writers) > 1 else ""
    click.echo(f"process {pid} has no memwatch ring of its own; showing the ring{'s' if writers[1:] else ''} of its "
               f"descendant process{plural} {', '.join(map(str, writers))}" + (f" ({printable(what)})" if what else ""),
               err=True)


def _hint(pid: int) -> None:
    """For a Python process without memwatch, say what --inject would do before watching from outside."""
    hint = inject_hint(pid)
    if hint:
        click.echo(hint, err=True)


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
    """Redraw the view in place on each sample; the last frame stays on screen. Piped, every frame is printed."""
    from rich.console import Console
    from rich.live import Live

    history: deque[Snapshot] = deque(maxlen=TREND_POINTS)
    console = Console()
    if not console.is_terminal:
        for snapshot in samples:
            history.append(snapshot)
            console.print(render(list(history)))
            console.print()
        return
    with Live(auto_refresh=False, console=console) as live:
        for snapshot in samples:
            history.append(snapshot)
            live.update(render(list(history)), refresh=True)


command = attach
"""The name the ``memwatch`` group registers commands under."""
