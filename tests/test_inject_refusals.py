"""`memwatch attach --inject` refusals: each check says one clear sentence with its exit code and leaves the
target as it was (not Python, gdb missing, a timeout, another user's process, ptrace denied, nothing to detach),
and, without ``--inject``, attach only says what injecting would do."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from injection import LIGHT, Target, memwatch, reap, started, target_env

from memwatch.attach.inject_checks import CAP_SYS_PTRACE, check_ptrace, check_user
from memwatch.errors import PermissionDeniedError

from processes import memwatch_env, wait_for


@pytest.fixture(autouse=True)
def _no_target_outlives_its_test() -> Iterator[None]:
    yield
    reap()


def test_a_process_that_is_not_python_is_refused(sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    absent = tmp_path / "absent"  # a path of this test's own that nothing creates, unlike a shared /nonexistent
    done = memwatch(memwatch_env(absent / "x.db", absent), "attach", "--inject",
                     str(sleeper.pid))
    assert done.returncode == 2
    assert done.stderr == (f"error: process {sleeper.pid} is not a Python process (sleep); "
                           "--inject works on Python engines only\n")


def test_without_gdb_on_the_path_the_injection_is_refused_and_nothing_changes(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LIGHT)
    env = target_env(runtime_dir, db_path)
    target = Target(script, env)
    done = memwatch({**env, "PATH": str(tmp_path / "empty")}, "attach", "--inject", str(target.proc.pid))
    assert done.returncode == 4
    assert done.stderr.startswith("error: gdb is not installed") and done.stderr.count("\n") == 1
    assert not list(runtime_dir.glob("*.ring"))
    out, err = target.finish()
    assert (out.splitlines()[-1], err) == ("threads ['MainThread']", "")


def test_an_injection_that_times_out_leaves_the_process_running_unchanged(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    # Pure Python arithmetic never releases the interpreter lock, so the process never reaches a safe point.
    script = tmp_path / "busy.py"
    script.write_text("import sys, time\nend = time.monotonic() + 6\nprint('ready', flush=True)\n"
                      "while time.monotonic() < end:\n    pass\n"
                      "print('memwatch loaded:', 'memwatch_engine' in sys.modules)\n")
    env = target_env(runtime_dir, db_path)
    target = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    assert target.stdout.readline() == "ready\n"
    done = memwatch(env, "attach", "--inject", str(target.pid), "--inject-timeout", "1.5")
    assert done.returncode == 4
    assert "reached no safe point within 1.5s" in done.stderr and "left it running" in done.stderr
    assert target.poll() is None
    out, _ = target.communicate(timeout=30)
    assert (target.returncode, out) == (0, "memwatch loaded: False\n")
    assert not list(runtime_dir.glob("*"))


def test_detach_of_a_process_memwatch_does_not_record_says_so(tmp_path: Path, runtime_dir: Path,
                                                              db_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LIGHT)
    env = target_env(runtime_dir, db_path)
    target = Target(script, env)
    done = memwatch(env, "attach", "--detach", str(target.proc.pid))
    target.finish()
    assert done.returncode == 3
    assert done.stderr == (f"error: process {target.proc.pid} is not being recorded by memwatch (no ring); "
                           "nothing to detach\n")


AS_NOBODY = """
import os, sys
from memwatch.cli import main
from memwatch.cli.attach import attach
import memwatch.attach.inject, memwatch.attach.inject_checks, memwatch.attach.hostinfo
main.add_command(attach)
os.setgid(65534)
os.setuid(65534)
main(sys.argv[1:], prog_name="memwatch")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root; the seam test below covers it")
def test_another_users_process_is_refused(tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LIGHT)
    env = target_env(runtime_dir, db_path)
    target = Target(script, env)  # root's process; memwatch runs as nobody
    done = subprocess.run([sys.executable, "-c", AS_NOBODY, "attach", "--inject", str(target.proc.pid)],
                          env=env, capture_output=True, text=True, timeout=60)
    target.finish()
    assert done.returncode == 5
    assert done.stderr == (f"error: process {target.proc.pid} belongs to uid 0, not to you (uid 65534); "
                           "run memwatch attach --inject as that user or as root\n")


def test_the_user_check_refuses_another_users_process_even_to_root() -> None:
    own, me = os.getpid(), os.geteuid()
    check_user(own)
    with pytest.raises(PermissionDeniedError, match=f"belongs to uid {me}, not to you"):
        check_user(own, euid=me + 1)
    # Root may trace it, but the rings would land in root's runtime directory, where its user's sidecar never looks.
    if me == 0:
        other = subprocess.Popen(["sleep", "30"], user=65534)
        started.append(other)
        pid, uid = other.pid, 65534
        wait_for(lambda: "65534" in Path(f"/proc/{pid}/status").read_text(), what="the process to be nobody's")
    else:
        pid, uid = own, me
    with pytest.raises(PermissionDeniedError, match=f"run memwatch as that user: sudo -u '#{uid}'"):
        check_user(pid, euid=0)


ALL_CAPABILITIES = (1 << 41) - 1  # CAP_CHOWN (0) to CAP_CHECKPOINT_RESTORE (40)


@pytest.mark.parametrize(("scope", "capabilities", "refused"), [
    ("0", 0, None),
    ("1", 0, "only your own child processes"),
    ("1", 1 << CAP_SYS_PTRACE, None),
    ("2", 0, "only a process with CAP_SYS_PTRACE"),
    ("2", 1 << CAP_SYS_PTRACE, None),
    ("3", 1 << CAP_SYS_PTRACE, "forbids tracing any process"),
    # Bit 19 itself (linux/capability.h), not the constant: every other capability together does not stand in.
    ("1", 1 << 19, None),
    ("2", 1 << 19, None),
    ("1", ALL_CAPABILITIES & ~(1 << 19), "only your own child processes"),
    ("2", ALL_CAPABILITIES & ~(1 << 19), "only a process with CAP_SYS_PTRACE"),
    ("2", 1 << 18, "only a process with CAP_SYS_PTRACE"),
    ("2", 1 << 20, "only a process with CAP_SYS_PTRACE"),
])
def test_ptrace_rules_of_yama_and_the_capability(tmp_path: Path, scope: str, capabilities: int,
                                                 refused: str | None) -> None:
    yama = tmp_path / "ptrace_scope"
    yama.write_text(scope + "\n")
    if refused is None:
        check_ptrace(os.getpid(), yama_path=yama, capabilities=capabilities)
    else:
        with pytest.raises(PermissionDeniedError, match=refused):
            check_ptrace(os.getpid(), yama_path=yama, capabilities=capabilities)
    check_ptrace(os.getpid(), yama_path=tmp_path / "absent", capabilities=0)  # no Yama: plain ptrace rules


def test_without_inject_attach_says_what_inject_would_do(tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LIGHT)
    env = target_env(runtime_dir, db_path)
    target = Target(script, env)
    done = memwatch(env, "attach", str(target.proc.pid), "--once")
    out, err = target.finish()
    note = done.stderr.splitlines()[0]
    assert note.startswith(f"note: process {target.proc.pid} is a Python process without memwatch; "
                           f"`memwatch attach --inject {target.proc.pid}` would record")
    assert "pauses the process" in note and "--detach" in note
    assert (out.splitlines()[-1], err) == ("threads ['MainThread']", "")  # nothing was run in it


