"""What must hold before memwatch runs code inside another process; each failure is one clear sentence.

The checks, in order: the process exists and belongs to this user (every one of its uids; root
too must run as the process's user); it is a Python interpreter of a version memwatch's engine
plugin runs on, learnt by reading its files, never by running them (:mod:`.pyversion`); the kernel
lets us trace it (Yama's ``ptrace_scope``, the ``CAP_SYS_PTRACE`` capability a container may lack,
no other debugger attached); and the tool that does the injection is installed (``gdb`` before
Python 3.14) where no user could have planted it (:mod:`.programs`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import MemwatchError, NotFoundError, PermissionDeniedError, UnavailableError, UsageError
from .programs import process_ids, trusted_tool
from .pyversion import embedded_version, mapped_libpython, named_version

MIN_VERSION = (3, 11)
REMOTE_EXEC_VERSION = (3, 14)
YAMA_PATH = Path("/proc/sys/kernel/yama/ptrace_scope")
CAP_SYS_PTRACE = 19
_PYTHON_NAME = re.compile(r"python[0-9.]*[a-z]?\Z")


@dataclass(frozen=True)
class Target:
    """A process that passed the checks: what injecting into it needs to know."""

    pid: int
    exe: str
    version: tuple[int, int]

    @property
    def method(self) -> str:
        return "remote_exec" if self.version >= REMOTE_EXEC_VERSION else "gdb"


def python_target(pid: int) -> Target:
    """The process as an injection target, or a clear refusal when it is not a Python process.

    Nothing of the process is executed: the version comes from the files it maps.
    """
    proc = Path(f"/proc/{pid}")
    try:
        exe = os.readlink(proc / "exe")
    except FileNotFoundError:
        if proc.exists():
            raise UsageError(f"process {pid} has no executable (a kernel thread); --inject works on Python engines "
                             "only") from None
        raise NotFoundError(f"no process {pid}; check the pid with ps") from None
    except PermissionError:
        if _owner(pid) in (None, os.geteuid()) or os.geteuid() == 0:
            raise PermissionDeniedError(f"the kernel does not let memwatch read process {pid}'s executable (a "
                                        "protected process, such as pid 1, a kernel thread or one that is not "
                                        "dumpable); memwatch cannot inject into it") from None
        raise PermissionDeniedError(f"cannot inspect process {pid}: it belongs to another user; "
                                    "run memwatch as that user (or as root)") from None
    name = os.path.basename(exe.removesuffix(" (deleted)"))
    version = mapped_libpython(pid) or named_version(name)
    if version is None and _PYTHON_NAME.search(name):
        version = embedded_version(pid)
        if version is None:
            raise UsageError(f"process {pid} runs {exe}, whose Python version could not be read from its name or "
                             "its bytes; --inject works on CPython 3.11 or newer")
    if version is None:
        raise UsageError(f"process {pid} is not a Python process ({name}); --inject works on Python engines only")
    if version < MIN_VERSION:
        raise UsageError(f"process {pid} runs Python {version[0]}.{version[1]}; memwatch's engine plugin "
                         f"needs Python {MIN_VERSION[0]}.{MIN_VERSION[1]} or newer")
    return Target(pid=pid, exe=exe, version=version)


def _owner(pid: int) -> int | None:
    uids, _ = process_ids(pid)
    return uids[0] if uids else None


def check_user(pid: int, euid: int | None = None) -> None:
    """The process must be ours, every uid of it (real, effective, saved, filesystem); root is no exception."""
    euid = os.geteuid() if euid is None else euid
    uids, _ = process_ids(pid)
    other = next((uid for uid in uids if uid != euid), None)
    if other is None:
        return
    if euid != 0:
        raise PermissionDeniedError(f"process {pid} belongs to uid {other}, not to you (uid {euid}); "
                                    "run memwatch attach --inject as that user or as root")
    # Root may trace anyone, but the rings must belong to the process's own user for its sidecar to trust them,
    # and nothing of another user's process may run with root's privileges.
    raise PermissionDeniedError(f"process {pid} belongs to uid {other}, whose rings must live in that user's "
                                f"runtime directory; run memwatch as that user: sudo -u '#{other}' memwatch attach "
                                f"--inject {pid}")


def check_ptrace(pid: int, yama_path: Path = YAMA_PATH, capabilities: int | None = None) -> None:
    """The kernel must let this process trace ``pid`` (gdb and ``sys.remote_exec`` both need it)."""
    if capabilities is None:
        capabilities = int(_status_field(os.getpid(), "CapEff") or "0", 16)
    can_trace_any = bool(capabilities >> CAP_SYS_PTRACE & 1)
    try:
        scope = int(yama_path.read_text().strip())
    except (OSError, ValueError):
        scope = 0  # no Yama: classic ptrace rules, same user may trace
    if scope >= 3:
        raise PermissionDeniedError(f"the kernel forbids tracing any process ({yama_path} is {scope}), so memwatch "
                                    f"cannot inject into process {pid}; only a reboot lifts that setting")
    if scope == 2 and not can_trace_any:
        raise PermissionDeniedError(f"only a process with CAP_SYS_PTRACE may trace others ({yama_path} is 2); "
                                    "run as root, or grant CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE)")
    if scope == 1 and not can_trace_any:
        raise PermissionDeniedError(f"the kernel lets you trace only your own child processes ({yama_path} is 1); "
                                    f"run as root, or set it to 0: sysctl kernel.yama.ptrace_scope=0")
    tracer = _status_field(pid, "TracerPid")
    if tracer not in (None, "0"):
        raise UnavailableError(f"process {pid} is already being traced by process {tracer} (a debugger?); "
                               "detach that first")


def check_tool(target: Target) -> str | None:
    """The injecting tool's path: gdb before Python 3.14; ``None`` when the interpreter does it itself."""
    if target.method == "remote_exec":
        return None
    gdb = trusted_tool("gdb")
    if gdb is None:
        raise UnavailableError(f"gdb is not installed (or only where another user could have put it), and process "
                               f"{target.pid} runs Python "
                               f"{target.version[0]}.{target.version[1]} (before 3.14 injection goes through gdb); "
                               "install it: apt-get install gdb")
    return gdb


def check_all(pid: int) -> tuple[Target, str | None]:
    """Every check, the owner first: nothing is read from another user's process before that passes."""
    check_user(pid)
    target = python_target(pid)
    check_ptrace(pid)
    return target, check_tool(target)


def _status_field(pid: int, name: str) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def inject_hint(pid: int) -> str | None:
    """What ``--inject`` would do for ``pid``, when it is a Python process that memwatch does not record."""
    from .hostinfo import HostWatcher
    from .ring_source import find_rings

    try:
        check_user(pid)  # root watching another user's process gets no hint: it could not inject as root
        python_target(pid)
        if find_rings({pid, *HostWatcher(pid).children()}):
            return None
    except MemwatchError:
        return None
    return (f"note: process {pid} is a Python process without memwatch; `memwatch attach --inject {pid}` would "
            "record its every step from inside (it pauses the process about a second to run a few lines of "
            f"Python; undo with --detach)")
