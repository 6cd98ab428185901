"""Whether a CPU is idle for this process now: work split over a second process pays only then.

On a busy machine a second process gains nothing, and the two halves of the work wait for each other,
which only widens the spread. "Idle" is judged three ways, each cheap to read: the CPUs this process may
run on (its affinity), its container's CPU quota (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), and
the host's tasks that are runnable at this moment. Only the process's own cgroup is read, not its parents'.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_MOST_BYTES = 4096
"""A cgroup or /proc file larger than this is not what it should be: it is not read."""


IDLE_ENOUGH = 0.5
"""CPUs idle on the host, besides this process's own, for a second process to be worth starting."""


def cpu_to_spare() -> bool:
    """Whether this process may use two CPUs and the host has one idle (at least half the time) besides its own."""
    usable = min(_affinity(), _quota() or math.inf)
    if usable < 2:
        return False
    online = os.cpu_count() or 1
    return online - _busy() >= IDLE_ENOUGH


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _busy() -> float:
    """CPUs busy on the host now, this process's own included: the runnable tasks at this moment.

    Not the load average: it counts the minute before this command, the user's previous commands with it.
    Where /proc/loadavg cannot be read, that average (plus this process) is all there is.
    """
    text = _read("/proc/loadavg")
    if text is not None:
        try:
            return float(int(text.split()[3].split("/")[0]))  # "0.52 0.31 0.22 3/412 5120": 3 runnable now
        except (IndexError, ValueError):
            pass
    try:
        return os.getloadavg()[0] + 1
    except OSError:
        return 1.0


def _quota() -> float | None:
    """The CPUs this process's cgroup may use, or ``None`` where it sets no limit (or cannot be read)."""
    cgroup = _read("/proc/self/cgroup") or ""
    for line in cgroup.splitlines():
        if line.startswith("0::"):  # cgroup v2: "0::/path"; its cpu.max is "max 100000" or "200000 100000"
            limit = (_read(str(Path("/sys/fs/cgroup", line[3:].strip().strip("/"), "cpu.max"))) or "").split()
            if len(limit) == 2:
                return None if limit[0] == "max" else _ratio(*limit)
    quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota is not None and period is not None:  # cgroup v1, as a container sees it: -1 is no limit
        return _ratio(quota.strip(), period.strip())
    return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        value, per = int(quota), int(period)
    except ValueError:
        return None
    return value / per if value > 0 and per > 0 else None


def _read(path: str) -> str | None:
    try:
        with Path(path).open("rb") as file:
            data = file.read(_MOST_BYTES + 1)
    except OSError:
        return None
    return data.decode("ascii", "replace") if len(data) <= _MOST_BYTES else None
