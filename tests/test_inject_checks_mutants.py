"""The injection checks refuse with their exact sentence at each edge: a pid that is gone, a zombie, an executable
the kernel hides, a program that is not Python, a Python too old (3.10 refused, 3.11 taken), a deleted interpreter,
every Yama scope, the tool a Python before 3.14 needs, the owner checked before anything else, and the hint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memwatch.attach import inject_checks
from memwatch.attach.inject_checks import Target, check_all, check_ptrace, check_tool, inject_hint, python_target
from memwatch.errors import NotFoundError, PermissionDeniedError, UnavailableError, UsageError

NOBODY = 65534
Start = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def start() -> Iterator[Start]:
    procs: list[subprocess.Popen[bytes]] = []

    def run(args: list[str], **popen: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, **popen)  # type: ignore[call-overload]
        procs.append(proc)
        return proc

    yield run
    for proc in procs:
        proc.kill()
        proc.communicate(timeout=30)


def python_child(start: Start, **popen: object) -> subprocess.Popen[bytes]:
    proc = start([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"], **popen)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def copy_of_sleep(tmp_path: Path, name: str) -> Path:
    sleep = shutil.which("sleep")
    assert sleep is not None
    fake = tmp_path / name
    fake.write_bytes(Path(sleep).read_bytes())
    fake.chmod(0o755)
    return fake


def test_a_pid_with_no_process_is_not_found() -> None:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # above the largest pid the kernel hands out
    with pytest.raises(NotFoundError) as refused:
        python_target(pid)
    assert str(refused.value) == f"no process {pid}; check the pid with ps"


def test_a_process_without_an_executable_is_refused_as_a_kernel_thread(start: Start) -> None:
    zombie = start(["true"])  # exited, not yet reaped: /proc/PID is there, its exe link is not
    deadline = time.monotonic() + 10
    while "State:\tZ" not in Path(f"/proc/{zombie.pid}/status").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(UsageError) as refused:
        python_target(zombie.pid)
    assert str(refused.value) == (f"process {zombie.pid} has no executable (a kernel thread); --inject works on "
                                  "Python engines only")


PROTECTED = ("the kernel does not let memwatch read process {pid}'s executable (a protected process, such as pid 1, "
             "a kernel thread or one that is not dumpable); memwatch cannot inject into it")


def deny(path: object) -> str:
    raise PermissionError(13, "Permission denied")


@pytest.mark.parametrize(("euid", "owner", "message"), [
    (0, 1000, PROTECTED),  # root may read anyone's: the kernel itself refuses
    (1000, 1000, PROTECTED),  # our own process: the kernel's doing
    (1000, None, PROTECTED),  # no owner known (no status to read): never called another user's
    (1000, 1001, "cannot inspect process {pid}: it belongs to another user; run memwatch as that user (or as root)"),
    (1000, 0, "cannot inspect process {pid}: it belongs to another user; run memwatch as that user (or as root)"),
])
def test_an_executable_the_kernel_hides_is_refused_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, euid: int, owner: int | None, message: str) -> None:
    # Seams: as root nothing can be refused to us, so the kernel's refusal and the user ids are stood in for.
    uids = [] if owner is None else [owner, owner, owner, owner]
    monkeypatch.setattr(inject_checks, "process_ids", lambda pid: (uids, uids))
    monkeypatch.setattr(inject_checks.os, "readlink", deny)
    monkeypatch.setattr(inject_checks.os, "geteuid", lambda: euid)
    with pytest.raises(PermissionDeniedError) as refused:
        python_target(4242)
    assert str(refused.value) == message.format(pid=4242)


def test_a_program_that_is_not_python_is_refused_by_name(start: Start) -> None:
    proc = start(["sleep", "30"])
    with pytest.raises(UsageError) as refused:
        python_target(proc.pid)
    assert str(refused.value) == (f"process {proc.pid} is not a Python process (sleep); --inject works on Python "
                                  "engines only")


def test_python_3_10_is_refused_and_3_11_is_taken(start: Start, tmp_path: Path) -> None:
    old = start([str(copy_of_sleep(tmp_path, "python3.10")), "30"])
    with pytest.raises(UsageError) as refused:
        python_target(old.pid)
    assert str(refused.value) == (f"process {old.pid} runs Python 3.10; memwatch's engine plugin needs Python 3.11 "
                                  "or newer")
    oldest = copy_of_sleep(tmp_path, "python3.11")
    new = start([str(oldest), "30"])
    assert python_target(new.pid) == Target(pid=new.pid, exe=str(oldest), version=(3, 11))


def test_a_deleted_interpreter_is_still_known_by_its_name(start: Start, tmp_path: Path) -> None:
    fake = copy_of_sleep(tmp_path, "python3.12")
    proc = start([str(fake), "30"])
    fake.unlink()
    assert python_target(proc.pid) == Target(pid=proc.pid, exe=f"{fake} (deleted)", version=(3, 12))


def test_a_running_python_is_a_target_with_its_own_version(start: Start) -> None:
    proc = python_child(start)
    exe = os.path.realpath(sys.executable)
    assert python_target(proc.pid) == Target(pid=proc.pid, exe=exe, version=sys.version_info[:2])


@pytest.mark.parametrize(("version", "method"), [((3, 11), "gdb"), ((3, 13), "gdb"), ((3, 14), "remote_exec"),
                                                 ((3, 15), "remote_exec"), ((4, 0), "remote_exec")])
def test_python_3_14_injects_itself_and_older_ones_through_gdb(version: tuple[int, int], method: str) -> None:
    assert Target(pid=1, exe="/usr/bin/python", version=version).method == method


def test_python_3_14_needs_no_tool_even_without_gdb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert check_tool(Target(pid=7, exe="/usr/bin/python3.14", version=(3, 14))) is None


def test_python_3_13_without_gdb_is_refused_with_its_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UnavailableError) as refused:
        check_tool(Target(pid=7, exe="/usr/bin/python3.13", version=(3, 13)))
    assert str(refused.value) == ("gdb is not installed (or only where another user could have put it), and process 7 "
                                  "runs Python 3.13 (before 3.14 injection goes through gdb); install it: "
                                  "apt-get install gdb")


@pytest.mark.skipif(not os.path.exists("/usr/bin/gdb"), reason="needs gdb in /usr/bin")
def test_python_3_13_with_gdb_gets_gdbs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin")
    assert check_tool(Target(pid=7, exe="/usr/bin/python3.13", version=(3, 13))) == "/usr/bin/gdb"


@pytest.mark.parametrize(("scope", "message"), [
    ("3", "the kernel forbids tracing any process ({yama} is 3), so memwatch cannot inject into process {pid}; "
          "only a reboot lifts that setting"),
    (" 4 \n", "the kernel forbids tracing any process ({yama} is 4), so memwatch cannot inject into process {pid}; "
              "only a reboot lifts that setting"),
    ("2\n", "only a process with CAP_SYS_PTRACE may trace others ({yama} is 2); run as root, or grant CAP_SYS_PTRACE "
            "(docker run --cap-add SYS_PTRACE)"),
    ("1\n", "the kernel lets you trace only your own child processes ({yama} is 1); run as root, or set it to 0: "
            "sysctl kernel.yama.ptrace_scope=0"),
])
def test_each_yama_scope_refuses_with_its_own_sentence(tmp_path: Path, scope: str, message: str) -> None:
    yama = tmp_path / "ptrace_scope"
    yama.write_text(scope)
    with pytest.raises(PermissionDeniedError) as refused:
        check_ptrace(os.getpid(), yama_path=yama, capabilities=0)
    assert str(refused.value) == message.format(yama=yama, pid=os.getpid())


def test_an_unreadable_yama_setting_counts_as_no_yama(tmp_path: Path) -> None:
    yama = tmp_path / "ptrace_scope"
    yama.write_text("restricted\n")
    check_ptrace(os.getpid(), yama_path=yama, capabilities=0)


@pytest.mark.parametrize("scope", ["1", "2"])
def test_without_capabilities_given_the_processs_own_decide(tmp_path: Path, scope: str) -> None:
    yama = tmp_path / "ptrace_scope"
    yama.write_text(scope)
    cap_eff = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:"))
    if int(cap_eff.split()[1], 16) >> 19 & 1:
        check_ptrace(os.getpid(), yama_path=yama)
    else:
        with pytest.raises(PermissionDeniedError):
            check_ptrace(os.getpid(), yama_path=yama)


def test_a_process_gone_before_its_tracer_is_read_is_not_called_traced(tmp_path: Path) -> None:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    check_ptrace(pid, yama_path=tmp_path / "absent", capabilities=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's process needs root to start")
def test_check_all_refuses_another_users_process_before_reading_anything(start: Start) -> None:
    proc = start(["sleep", "30"], user=NOBODY, group=NOBODY, extra_groups=[])
    deadline = time.monotonic() + 10
    while f"Uid:\t{NOBODY}" not in Path(f"/proc/{proc.pid}/status").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(PermissionDeniedError, match=f"belongs to uid {NOBODY}"):
        check_all(proc.pid)  # not "not a Python process": the owner is checked first
    assert inject_hint(proc.pid) is None  # root gets no hint for another user's process


def test_check_all_refuses_a_program_that_is_not_python(start: Start) -> None:
    proc = start(["sleep", "30"])
    with pytest.raises(UsageError, match=r"is not a Python process \(sleep\)"):
        check_all(proc.pid)


@pytest.mark.skipif(not os.path.exists("/usr/bin/gdb"), reason="needs gdb in /usr/bin")
def test_check_all_of_a_python_process_gives_its_target_and_tool(
        monkeypatch: pytest.MonkeyPatch, start: Start, tmp_path: Path) -> None:
    proc = python_child(start)
    monkeypatch.setattr(inject_checks, "YAMA_PATH", tmp_path / "absent")
    monkeypatch.setenv("PATH", "/usr/bin")
    expected = Target(pid=proc.pid, exe=os.path.realpath(sys.executable), version=sys.version_info[:2])
    tool = None if expected.version >= (3, 14) else "/usr/bin/gdb"
    assert check_all(proc.pid) == (expected, tool)


def test_the_hint_is_for_a_python_process_without_memwatch_only(start: Start) -> None:
    proc = python_child(start)
    assert inject_hint(proc.pid) == (
        f"note: process {proc.pid} is a Python process without memwatch; `memwatch attach --inject {proc.pid}` would "
        "record its every step from inside (it pauses the process about a second to run a few lines of Python; "
        "undo with --detach)")
    other = start(["sleep", "30"])
    assert inject_hint(other.pid) is None
    assert inject_hint(int(Path("/proc/sys/kernel/pid_max").read_text()) + 1) is None
