"""vLLM's own teardown of its engine processes, seen from the front end that does it.

vLLM's front end (``vllm serve``'s API server, ``AsyncLLM``, ``LLM``) ends its engine core with SIGTERM and,
with the default ``shutdown_timeout`` of 0, SIGKILLs it and every process below it (the workers) at once
(``CoreEngineProcManager.shutdown`` → ``vllm.v1.utils.shutdown`` → ``kill_process_tree``). No Python code of
theirs runs after that, so their rings stay open and the sidecar would record a crash for a server stopped
with Ctrl-C. The front end is the parent that ends them, the one process that knows the kill is an orderly
shutdown: just before vLLM's ``shutdown`` signals them, the rings of this run written by the engine
processes still alive (not already exiting), and by every process below them, are marked closed.

A writer still running goes on writing (its own ``close`` later marks the ring again, harmlessly): the
sidecar takes a closed flag for an end only once the writer is gone, and then stores ``ok``, with every
record drained. An engine process already dead when the shutdown began (killed, crashed, out of memory)
is not marked, nor anything below it: that run is ``crashed``, as the sidecar finds it.
Upstream interface followed: vLLM 0.32.0 CPU, 0.33.0, 0.34.0 (``vllm/v1/engine/utils.py``, ``vllm/v1/utils.py``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from multiprocessing.connection import wait
from pathlib import Path
from types import ModuleType
from typing import Any

from ...ring_format import _FLAGS, _FLAGS_AT, FLAG_CLOSED
from ...ring_reader import RingReader
from ...runtime import default_runtime_dir
from ..hooks import Guard, patch_on_import, wrap_function

TEARDOWN_MODULE = "vllm.v1.engine.utils"
"""Where ``CoreEngineProcManager`` calls ``shutdown(procs, timeout)``, imported by name from ``vllm.v1.utils``."""

_guard = Guard("vLLM teardown")


def install() -> None:
    """Follow the front end's teardown of its engine processes (in every process; only a front end calls it)."""
    patch_on_import(TEARDOWN_MODULE, patch_teardown)


def patch_teardown(module: ModuleType) -> None:
    wrap_function(module, "shutdown", _wrap_shutdown)


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(procs: Any, *args: Any, **kwargs: Any) -> Any:
        _guard.call(_mark_ending, procs)
        return original(procs, *args, **kwargs)

    return shutdown


def _mark_ending(procs: Iterable[Any]) -> None:
    """The rings of the processes ``procs`` is ending marked closed: one call, so the guard sees all of it."""
    close_rings_of(ending_pids(procs))


def ending_pids(procs: Iterable[Any]) -> set[int]:
    """The engine processes alive now (``multiprocessing`` processes) and every process below them.

    A process already exiting is not alive here, though ``is_alive()`` may still say so: vLLM's liveness monitor
    calls ``shutdown`` as soon as an engine's sentinel (a pipe the child holds) closes, which the kernel does
    while the killed process exits, before it can be reaped. So a readable sentinel counts as dead.
    """
    alive = {int(proc.pid) for proc in procs
             if proc.pid is not None and proc.is_alive() and not _exiting(getattr(proc, "sentinel", None))}
    return alive | set(descendants(alive))


def _exiting(sentinel: int | None) -> bool:
    return sentinel is not None and bool(wait([sentinel], timeout=0))


def descendants(roots: Iterable[int]) -> list[int]:
    """Every process below ``roots``, read from ``/proc/*/stat`` (a process gone meanwhile is skipped)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as handle:
                    parent = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    queue = list(roots)
    while queue:
        for child in children.get(queue.pop(), ()):
            found.append(child)
            queue.append(child)
    return found


def close_rings_of(pids: set[int], run_id: str | None = None, directory: Path | None = None) -> list[str]:
    """Mark closed this run's rings (``$MEMWATCH_RUN_ID``) written by ``pids``; the names of those marked.

    Only regular files of our own uid, opened without following links; a ring of another run, of another
    writer, or one that is not a ring is left as it is.
    """
    run_id = run_id or os.environ.get("MEMWATCH_RUN_ID")
    directory = directory or default_runtime_dir()
    if not run_id or not pids:
        return []
    try:
        names = sorted(name for name in os.listdir(directory) if name.startswith(f"{run_id}-r") and
                       name.endswith(".ring"))
    except OSError:
        return []
    marked = []
    for name in names:
        try:
            fd = os.open(directory / name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                continue
            header = RingReader(directory / name, fd=os.dup(fd))
            writer, ring_run = header.header.writer_pid, header.header.run_id
            header.close()
            if ring_run != run_id or writer not in pids:
                continue
            (flags,) = _FLAGS.unpack(os.pread(fd, _FLAGS.size, _FLAGS_AT))
            os.pwrite(fd, _FLAGS.pack(flags | FLAG_CLOSED), _FLAGS_AT)
            marked.append(name)
        except Exception:  # not a ring, or one being removed: left alone
            continue
        finally:
            os.close(fd)
    return marked
