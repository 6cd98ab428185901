"""``memwatch attach``: watch one running process's GPU memory, live or as JSON lines.

Library use::

    from contextlib import closing

    from memwatch.attach import open_source, watch

    with closing(open_source(1234)) as source:
        for snapshot in watch(source, interval_s=1.0, duration_s=10):
            print(snapshot.to_dict())
"""

from __future__ import annotations

import time
from pathlib import Path

from ..nvml import NvmlUnavailable
from .hostinfo import HostWatcher
from .loop import watch
from .nvml_source import NvmlSource
from .ring_source import RingSource, find_rings
from .snapshot import GpuUsage, ProcessUsage, RankLedger, Snapshot, Source

YOUNG_PROCESS_SECONDS = 3.0
"""A process younger than this may not have created its ring yet (``memwatch sim ... & memwatch attach $!``)."""
EXEC_SECONDS = 0.5
"""A process younger than this may still be the shell's fork, before it executes Python."""


def open_source(pid: int, runtime_dir: Path | None = None) -> Source:
    """The source for ``pid``: its rings when it runs the memwatch plugin, else NVML and psutil.

    A Python process that started less than :data:`YOUNG_PROCESS_SECONDS` ago gets until that age to
    create a ring.
    """
    host = HostWatcher(pid)
    found = find_rings({pid, *host.children()}, runtime_dir)
    born = host.create_time_s()
    while not found and time.time() < born + YOUNG_PROCESS_SECONDS:
        # a shell's `cmd &` is a fork that becomes Python a moment later: judge it once it had time to exec
        if time.time() > born + EXEC_SECONDS and not host.is_python():
            break
        time.sleep(0.05)
        found = find_rings({pid, *host.children()}, runtime_dir)
    if found:
        return RingSource(pid, runtime_dir=runtime_dir, host=host)
    try:
        return NvmlSource(pid, host=host)
    except NvmlUnavailable as exc:
        raise NvmlUnavailable(f"{exc}; process {pid} is not instrumented either (no memwatch ring), so there "
                              "is nothing to read: start it with MEMWATCH=1") from None


__all__ = [
    "GpuUsage", "NvmlSource", "ProcessUsage", "RankLedger", "RingSource", "Snapshot", "Source", "open_source",
    "watch",
]
