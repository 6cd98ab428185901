"""From a pid inside a container's pid namespace to the pid the host (and NVML) knows it by.

A ring written in a container names its writer by the pid it has there (often 1) and records that
pid namespace (its inode). ``memwatch attach`` on the host is given host pids, and NVML reports host
pids; the two meet through ``/proc/PID/status``, whose ``NSpid`` line lists a process's pid in every
namespace it belongs to, the reader's first and its own last.

``/proc`` is outside input: the scan is bounded (at most :data:`MAX_PROCESSES` entries, the first
:data:`MAX_STATUS` bytes of each status) and a line that is not what the kernel writes is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_PROCESSES = 65_536
MAX_STATUS = 8192


def ns_pids(pid: int | str, proc: Path = Path("/proc")) -> tuple[int, ...] | None:
    """The process's pid in each pid namespace it is in, ours first (None when unreadable)."""
    try:
        with open(proc / str(pid) / "status", "rb") as f:
            status = f.read(MAX_STATUS)
    except OSError:
        return None
    for line in status.split(b"\n"):
        if line.startswith(b"NSpid:"):
            fields = line[6:].split()
            if not fields or len(fields) > 32 or not all(f.isdigit() and len(f) <= 10 for f in fields):
                return None
            return tuple(int(f) for f in fields)
    return None


def pid_namespace_of(pid: int | str, proc: Path = Path("/proc")) -> int | None:
    try:
        return os.stat(proc / str(pid) / "ns" / "pid").st_ino
    except OSError:
        return None


def host_pid(inner_pid: int, namespace: int, proc: Path = Path("/proc")) -> int | None:
    """The pid, as we see it, of the process that is ``inner_pid`` in pid namespace ``namespace``."""
    try:
        entries = os.scandir(proc)
    except OSError:
        return None
    with entries:
        for count, entry in enumerate(entries):
            if count >= MAX_PROCESSES:
                break
            if not entry.name.isdigit():
                continue
            pids = ns_pids(entry.name, proc)
            if pids is None or len(pids) < 2 or pids[-1] != inner_pid:
                continue
            if pid_namespace_of(entry.name, proc) == namespace:
                return pids[0]
    return None
