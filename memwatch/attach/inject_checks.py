"""What must hold before memwatch runs code inside another process; each failure is one clear sentence.

The checks, in order: the process exists; it is a Python interpreter of a version memwatch's engine
plugin runs on; it belongs to this user (or we are root); the kernel lets us trace it (Yama's
``ptrace_scope``, the ``CAP_SYS_PTRACE`` capability a container may lack, no other debugger attached);
and the tool that does the injection is installed (``gdb`` before Python 3.14).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import MemwatchError, NotFoundError, PermissionDeniedError, UnavailableError, UsageError

MIN_VERSION = (3, 11)
REMOTE_EXEC_VERSION = (3, 14)
YAMA_PATH = Path("/proc/sys/kernel/yama/ptrace_scope")
CAP_SYS_PTRACE = 19
_PYTHON_NAME = re.compile(r"python[0-9.]*[a-z]?$")
_LIBPYTHON = re.compile(r"/libpython(\d+)\.(\d+)[a-z]*\.so")


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
    """The process as an injection target, or a clear refusal when it is not a Python process."""
    proc = Path(f"/proc/{pid}")
    try:
        exe = os.readlink(proc / "exe")
    except FileNotFoundError:
        raise NotFoundError(f"no process {pid}; check the pid with ps") from None
    except PermissionError:
        raise PermissionDeniedError(f"cannot inspect process {pid}: it belongs to another user; "
                                    "run memwatch as that user (or as root)") from None
    version = _libpython_version(proc) if not _PYTHON_NAME.search(os.path.basename(exe)) else None
    if version is None and not _PYTHON_NAME.search(os.path.basename(exe)):
        raise UsageError(f"process {pid} is not a Python process ({os.path.basename(exe)}); "
                         "--inject works on Python engines only")
    if version is None:
        version = _interpreter_version(pid, exe)
    if version < MIN_VERSION:
        raise UsageError(f"process {pid} runs Python {version[0]}.{version[1]}; memwatch's engine plugin "
                         f"needs Python {MIN_VERSION[0]}.{MIN_VERSION[1]} or newer")
    return Target(pid=pid, exe=exe, version=version)


def _libpython_version(proc: Path) -> tuple[int, int] | None:
    try:
        maps = (proc / "maps").read_text()
    except OSError:
        return None
    found = _LIBPYTHON.search(maps)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _interpreter_version(pid: int, exe: str) -> tuple[int, int]:
    """Ask the target's own interpreter binary (isolated, no site) which version it is."""
    try:
        done = subprocess.run([f"/proc/{pid}/exe", "-I", "-S", "-c", "import sys; print(*sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=10)
        major, minor = (int(part) for part in done.stdout.split())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        raise UsageError(f"process {pid} runs {exe}, whose Python version could not be read; "
                         "--inject works on CPython 3.11 or newer") from None
    return major, minor


def check_user(pid: int, euid: int | None = None) -> None:
    """The process must be ours, or we must be root."""
    euid = os.geteuid() if euid is None else euid
    field = _status_field(pid, "Uid")
    uid = int(field.split()[0]) if field else euid
    if uid == euid:
        return
    if euid != 0:
        raise PermissionDeniedError(f"process {pid} belongs to uid {uid}, not to you (uid {euid}); "
                                    "run memwatch attach --inject as that user or as root")
    # Root may trace anyone, but the rings must belong to the process's own user for its sidecar to trust them.
    raise PermissionDeniedError(f"process {pid} belongs to uid {uid}, whose rings must live in that user's runtime "
                                f"directory; run memwatch as that user: sudo -u '#{uid}' memwatch attach --inject "
                                f"{pid}")


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
    gdb = shutil.which("gdb")
    if gdb is None:
        raise UnavailableError(f"gdb is not installed, and process {target.pid} runs Python "
                               f"{target.version[0]}.{target.version[1]} (before 3.14 injection goes through gdb); "
                               "install it: apt-get install gdb")
    return gdb


def check_all(pid: int) -> tuple[Target, str | None]:
    target = python_target(pid)
    check_user(pid)
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
    from ..hostinfo import HostWatcher
    from .ring_source import find_rings

    try:
        python_target(pid)
        if find_rings({pid, *HostWatcher(pid).children()}):
            return None
    except MemwatchError:
        return None
    return (f"note: process {pid} is a Python process without memwatch; `memwatch attach --inject {pid}` would "
            "record its every step from inside (it pauses the process about a second to run a few lines of "
            f"Python; undo with --detach)")
