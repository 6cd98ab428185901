"""The checks before an injection at their edges: every one of a process's uids counts (a saved or filesystem
uid of another user refuses it), CAP_SYS_PTRACE is capability 19, a process that already has a tracer is
refused, a program started as the target's user keeps none of root's groups, and a binary that holds a CPython
version string but is not CPython has no version."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memwatch.attach.inject_checks import check_ptrace, check_user, python_target
from memwatch.attach.programs import CLEAN_ENV, as_target
from memwatch.errors import PermissionDeniedError, UnavailableError, UsageError

NOBODY = 65534
Spawn = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start a process and wait (at most 30 s) for its first line; every one is killed after the test."""
    procs: list[subprocess.Popen[str]] = []

    def start(args: list[str], *, says_ready: bool = True, **popen: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen)
        procs.append(proc)
        if not says_ready:
            return proc  # Popen returns once the program is exec'd: /proc/PID/exe already names it
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, f"{args[0]} printed nothing within 30 s"
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.communicate(timeout=30)  # reaps it and closes its pipes


def python(code: str) -> list[str]:
    """A Python process that runs ``code``, says ``ready`` and then waits for its standard input to close."""
    return [sys.executable, "-c", f"import ctypes, os, sys\n{code}\nprint('ready', flush=True)\nsys.stdin.read()"]


def uids(pid: int) -> list[int]:
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:"))
    return [int(part) for part in line.split()[1:]]


def test_a_process_whose_saved_uid_is_another_users_is_refused(spawn: Spawn) -> None:
    # Real and effective uid nobody, saved uid root: to nobody it is not its own process.
    proc = spawn(python(f"os.setresgid({NOBODY}, {NOBODY}, {NOBODY}); os.setresuid({NOBODY}, {NOBODY}, 0)"))
    assert uids(proc.pid) == [NOBODY, NOBODY, 0, NOBODY]
    with pytest.raises(PermissionDeniedError) as refused:
        check_user(proc.pid, euid=NOBODY)
    assert str(refused.value) == (f"process {proc.pid} belongs to uid 0, not to you (uid {NOBODY}); "
                                  "run memwatch attach --inject as that user or as root")


def test_a_process_whose_filesystem_uid_is_another_users_is_refused_even_to_root(spawn: Spawn) -> None:
    # Root in every uid but the filesystem one, which is nobody's: its files would be written as nobody.
    proc = spawn(python(f"ctypes.CDLL(None).setfsuid({NOBODY})"))
    assert uids(proc.pid) == [0, 0, 0, NOBODY]
    with pytest.raises(PermissionDeniedError) as refused:
        check_user(proc.pid, euid=0)
    assert str(refused.value) == (f"process {proc.pid} belongs to uid {NOBODY}, whose rings must live in that "
                                  f"user's runtime directory; run memwatch as that user: sudo -u '#{NOBODY}' "
                                  f"memwatch attach --inject {proc.pid}")


def test_a_process_already_being_traced_is_refused_and_an_untraced_one_is_not(spawn: Spawn, tmp_path: Path) -> None:
    no_yama = tmp_path / "absent"
    untraced = spawn(python(""))
    check_ptrace(untraced.pid, yama_path=no_yama, capabilities=1 << 19)
    # PTRACE_TRACEME (request 0) makes this test process the child's tracer; it never stops the child.
    traced = spawn(python("assert ctypes.CDLL(None).ptrace(0, 0, None, None) == 0"))
    with pytest.raises(UnavailableError) as refused:
        check_ptrace(traced.pid, yama_path=no_yama, capabilities=1 << 19)
    assert str(refused.value) == (f"process {traced.pid} is already being traced by process {os.getpid()} "
                                  "(a debugger?); detach that first")


AS_TARGET = """
import subprocess, sys
from memwatch.attach.programs import as_target
done = subprocess.run([sys.argv[1], "-u"], **as_target(int(sys.argv[2])), capture_output=True, text=True)
groups = subprocess.run([sys.argv[1], "-G"], **as_target(int(sys.argv[2])), capture_output=True, text=True)
print(done.stdout.strip(), groups.stdout.strip())
"""


def test_as_target_runs_as_the_targets_user_and_group_without_roots_extra_groups(spawn: Spawn) -> None:
    target = spawn(["/bin/sh", "-c", "echo ready; exec cat"], user=NOBODY, group=NOBODY, extra_groups=[])
    if os.geteuid() != 0:
        assert as_target(target.pid) == {"env": CLEAN_ENV, "cwd": "/"}  # no user to switch to
        return
    ident = shutil.which("id")
    assert ident is not None
    # The caller holds supplementary groups 0, 4 and 27; none of them may reach the program.
    done = subprocess.run([sys.executable, "-c", AS_TARGET, ident, str(target.pid)], capture_output=True, text=True,
                          timeout=60, extra_groups=[0, 4, 27])
    assert (done.returncode, done.stdout) == (0, f"{NOBODY} {NOBODY}\n")


@pytest.mark.parametrize(("appended", "version"), [
    (b"\x003.12.1\x00", None),  # a version string alone: any program may hold one
    (b"\x003.12.1\x00_PyRuntime\x00", (3, 12)),  # with the symbol every CPython exports: CPython 3.12
])
def test_a_binary_named_python3_is_cpython_only_with_the_runtime_symbol(
    spawn: Spawn, tmp_path: Path, appended: bytes, version: tuple[int, int] | None
) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None and b"_PyRuntime" not in Path(sleep).read_bytes()
    fake = tmp_path / "python3"
    fake.write_bytes(Path(sleep).read_bytes() + appended)  # still runs: the loader ignores bytes past the ELF
    fake.chmod(0o755)
    proc = spawn([str(fake), "30"], says_ready=False)
    assert os.readlink(f"/proc/{proc.pid}/exe") == str(fake)
    if version is None:
        with pytest.raises(UsageError) as refused:
            python_target(proc.pid)
        assert str(refused.value) == (f"process {proc.pid} runs {fake}, whose Python version could not be read from "
                                      "its name or its bytes; --inject works on CPython 3.11 or newer")
    else:
        assert python_target(proc.pid).version == version
