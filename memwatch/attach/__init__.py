"""``memwatch attach``: watch one running process's GPU memory, live or as JSON lines.

Library use::

    from contextlib import closing

    from memwatch.attach import open_source, watch

    with closing(open_source(1234)) as source:
        for snapshot in watch(source, interval_s=1.0, duration_s=10):
            print(snapshot.to_dict())
"""

from __future__ import annotations

from .loop import watch
from .nvml_source import NvmlSource
from .snapshot import GpuUsage, ProcessUsage, RankLedger, Snapshot, Source


def open_source(pid: int) -> Source:
    """The source for ``pid``: a plain process is watched from outside through NVML and psutil."""
    return NvmlSource(pid)


__all__ = ["GpuUsage", "NvmlSource", "ProcessUsage", "RankLedger", "Snapshot", "Source", "open_source", "watch"]
