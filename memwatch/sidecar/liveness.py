"""Is a ring's writer still alive? Answered without relying on seeing its pid.

A ring written by this memwatch says two things about its writer (:mod:`memwatch_engine.liveness`):
it holds a lock on the ring for as long as it lives (``writer_lock``), and which pid namespace it
runs in (``pid_ns``). The sidecar decides:

- the writer's lock is gone → the writer is gone (it died, or closed the ring);
- the writer's pid namespace is the sidecar's own (or not recorded: a ring from an older memwatch) →
  the pid decides as well, so a forked child that outlives the writer does not keep it "alive";
- a namespace of its own with the lock held → alive; with no lock to ask (a filesystem that refuses
  locks) → taken as alive: the sidecar cannot see that process, and a run is never ended on a guess.
"""

from __future__ import annotations

import logging
from typing import Any

from memwatch_engine.liveness import pid_namespace, writer_lock_held

log = logging.getLogger("memwatch.liveness")

_OWN_PID_NS = pid_namespace()


def writer_alive(pid: int, start_ticks: int) -> bool:
    """Whether the ring's writer still runs: the pid exists, is not a zombie, and is the same process.

    One read of ``/proc/PID/stat`` gives both the state and the start time. Only meaningful in the
    writer's own pid namespace.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fields = stat[stat.rindex(b")") + 2 :].split()
        state, started = fields[0], int(fields[19])
    except (ValueError, IndexError):
        return True
    if state in (b"Z", b"X"):
        return False
    return not (start_ticks and started != start_ticks)


def same_pid_namespace(meta: dict[str, Any], own: int | None = _OWN_PID_NS) -> bool:
    """Whether the writer's pid is meaningful here: its namespace is ours, or unrecorded (an older ring)."""
    recorded = meta.get("pid_ns")
    if recorded is None:
        return True
    return type(recorded) is int and own is not None and recorded == own


def ring_writer_alive(fd: int, pid: int, start_ticks: int, meta: dict[str, Any]) -> bool:
    """Whether the writer of the ring open as ``fd`` lives, by its lock and, where visible, its pid."""
    if meta.get("writer_lock") == 1 and writer_lock_held(fd) is False:
        return False
    if same_pid_namespace(meta):
        return writer_alive(pid, start_ticks)
    return True
