"""``memwatch attach``: watch one running process's GPU memory, live or as JSON lines.

Library use::

    from contextlib import closing

    from memwatch.attach import open_source, watch

    with closing(open_source(1234)) as source:
        for snapshot in watch(source, interval_s=1.0, duration_s=10):
            print(snapshot.to_dict())
"""

from __future__ import annotations

from pathlib import Path

from ..hostinfo import HostWatcher
from ..nvml import NvmlUnavailable
from .loop import watch
from .nvml_source import NvmlSource
from .ring_source import RingSource, find_rings
from .snapshot import GpuUsage, ProcessUsage, RankLedger, Snapshot, Source


def open_source(pid: int, runtime_dir: Path | None = None) -> Source:
    """The source for ``pid``: its rings when it runs the memwatch plugin, else NVML and psutil."""
    host = HostWatcher(pid)
    if find_rings({pid, *host.children()}, runtime_dir):
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
