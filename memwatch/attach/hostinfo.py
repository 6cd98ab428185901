"""The host side of a process, from psutil: who runs it, what it is, what it costs, which children it has.

Children are collected recursively because inference engines put tensor-parallel workers in child
(or grandchild) processes, and those are the ones holding GPU memory.

CPU percent needs two readings; a :class:`HostWatcher` starts the measurement when it is created,
so its first :meth:`HostWatcher.sample` already covers the time since then. The kernel counts CPU
time in 10 ms ticks, so a window of a few milliseconds reads 0 % or several hundred; the first
sample therefore waits until :data:`MIN_CPU_WINDOW_S` has passed (once, at most that long).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psutil

from ..errors import NotFoundError, PermissionDeniedError

MIN_CPU_WINDOW_S = 0.1
"""Shortest time the first CPU percent is measured over (ten kernel ticks)."""


class ProcessExited(Exception):
    """The watched process is gone; not an error, the normal end of watching it."""

    def __init__(self, pid: int) -> None:
        super().__init__(f"process {pid} exited")
        self.pid = pid


@dataclass(frozen=True)
class HostProcess:
    """One reading of a process as the host sees it. ``None``: the OS would not tell us."""

    pid: int
    name: str
    cmdline: tuple[str, ...]
    user: str | None
    rss_bytes: int | None
    cpu_percent: float | None
    """Percent of one CPU since the previous sample (so it can exceed 100)."""
    status: str
    create_time_ns: int
    children: tuple[int, ...]
    """Every descendant pid, recursively, in psutil's order."""


class HostWatcher:
    """Samples one process again and again, keeping the psutil handle so CPU percent has a baseline."""

    def __init__(self, pid: int, *, euid: int | None = None) -> None:
        """Open ``pid``; :class:`NotFoundError` if it does not exist, :class:`PermissionDeniedError` if
        it belongs to another user and ``euid`` (default: ours) is not root."""
        self.pid = pid
        try:
            self._process = psutil.Process(pid)
            owner_uid = self._process.uids().real
            if self._process.status() == psutil.STATUS_ZOMBIE:
                raise psutil.NoSuchProcess(pid)
            self._process.cpu_percent(None)
        except psutil.NoSuchProcess:
            raise NotFoundError(f"no process with pid {pid}; check the pid with `ps -p {pid}`") from None
        except psutil.AccessDenied:
            raise _permission_error(pid, None) from None
        me = os.geteuid() if euid is None else euid
        if me != 0 and owner_uid != me:
            raise _permission_error(pid, _user_name(self._process))
        self._cpu_window_ends: float | None = time.monotonic() + MIN_CPU_WINDOW_S

    def create_time_s(self) -> float:
        """When the process started (Unix seconds); 0 when it cannot be read."""
        try:
            return float(self._process.create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return 0.0

    def is_python(self) -> bool:
        """Whether the process is a Python interpreter (only those can load the memwatch plugin)."""
        try:
            if "python" in self._process.name().lower():
                return True
            # a console script (`memwatch sim`) is named after the script; its executable is still Python
            return "python" in os.path.basename(self._process.exe()).lower()
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            return False

    def children(self) -> tuple[int, ...]:
        """Every descendant pid, recursively (cheaper than a sample; leaves the CPU measurement alone)."""
        try:
            return tuple(child.pid for child in self._process.children(recursive=True))
        except psutil.NoSuchProcess:
            raise ProcessExited(self.pid) from None
        except psutil.AccessDenied:
            return ()

    def sample(self) -> HostProcess:
        """The process now; :class:`ProcessExited` once it is gone (or a zombie waiting to be reaped)."""
        process = self._process
        if self._cpu_window_ends is not None:
            time.sleep(max(0.0, self._cpu_window_ends - time.monotonic()))
            self._cpu_window_ends = None
        try:
            with process.oneshot():
                status = process.status()
                if status == psutil.STATUS_ZOMBIE:
                    raise ProcessExited(self.pid)
                name = process.name()
                cmdline = tuple(_optional(process.cmdline) or ())
                user = _user_name(process)
                memory = _optional(process.memory_info)
                cpu = _optional(lambda: process.cpu_percent(None))
                created_ns = int(process.create_time() * 1e9)
            children = self.children()
        except psutil.NoSuchProcess:
            raise ProcessExited(self.pid) from None
        return HostProcess(
            pid=self.pid,
            name=name,
            cmdline=cmdline,
            user=user,
            rss_bytes=None if memory is None else int(memory.rss),
            cpu_percent=cpu,
            status=status,
            create_time_ns=created_ns,
            children=children,
        )


T = TypeVar("T")


def _optional(read: Callable[[], T]) -> T | None:
    """``read()``, or ``None`` where the OS denies it (another user's process, hardened /proc)."""
    try:
        return read()
    except psutil.AccessDenied:
        return None


def _user_name(process: psutil.Process) -> str | None:
    """The owner's login name (psutil falls back to the numeric uid when there is no passwd entry)."""
    return _optional(process.username)


def _permission_error(pid: int, user: str | None) -> PermissionDeniedError:
    owner = f"user {user}" if user is not None else "another user"
    return PermissionDeniedError(
        f"process {pid} belongs to {owner}; run memwatch as that user or as root"
    )
