"""`memwatch attach` run by root never executes anything of the process it looks at.

A local user can name any binary ``python3``, run it, and wait for an administrator to attach. The
binaries here are real programs compiled by the test: each appends its effective uid to a marker
file every time it runs, so the marker proves whether memwatch ever executed it (and as whom).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from injection import LIGHT, Target, memwatch, needs_gdb_calls, reap, target_env
from trusted_dirs import trusted_scratch

from memwatch.attach.inject import remote_exec_interpreter
from memwatch.attach.inject_checks import Target as CheckedTarget
from memwatch.attach.inject_checks import python_target
from memwatch.attach.programs import trusted_tool
from memwatch.errors import UnavailableError

from processes import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the escalation exists only when memwatch runs as root")

NOBODY = 65534
RECORDER = r"""
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    FILE *f = fopen(MARKER, "a");
    if (f) { fprintf(f, "euid=%d argc=%d\n", (int) geteuid(), argc); fclose(f); }
    if (argc > 1) { puts("3 12"); return 0; }  /* what the old version probe asked: "Python 3.12" */
    for (;;) pause();
}
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder nobody can use (pytest's tmp_path is closed to other users), owned by nobody."""
    folder = Path(tempfile.mkdtemp(prefix="memwatch-escalation-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _recorder(folder: Path, owner: int) -> tuple[Path, Path]:
    marker = folder / "runs.txt"
    source = folder / "recorder.c"
    source.write_text(RECORDER)
    binary = folder / "python3"
    subprocess.run(["cc", f'-DMARKER="{marker}"', "-o", str(binary), str(source)], check=True, timeout=60)
    marker.touch()
    for path in (folder, binary, marker):
        os.chown(path, owner, owner)
    marker.chmod(0o666)
    return binary, marker


@pytest.fixture
def trusted_dir() -> Iterator[Path]:
    """A folder of root's whose every folder up to / is root's alone: what memwatch runs programs from."""
    with trusted_scratch() as folder:
        yield folder


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)
    reap()


def _run_as(binary: Path, uid: int, started: list[subprocess.Popen[bytes]], marker: Path) -> int:
    proc = subprocess.Popen([str(binary)], user=uid, group=uid, extra_groups=[] if uid else None, cwd="/", env={})
    started.append(proc)
    wait_for(lambda: marker.read_text().count("\n") == 1, timeout=10, what="the recorder to start")
    assert marker.read_text() == f"euid={uid} argc=1\n"
    return proc.pid


def test_attach_never_runs_another_users_python3_as_root(shared_dir: Path, tmp_path: Path,
                                                        started: list[subprocess.Popen[bytes]]) -> None:
    binary, marker = _recorder(shared_dir, NOBODY)
    pid = _run_as(binary, NOBODY, started, marker)
    env = target_env(tmp_path / "runtime", tmp_path / "db.sqlite")
    watched = memwatch(env, "attach", str(pid), "--once", "--json", timeout=20)
    injected = memwatch(env, "attach", "--inject", str(pid), timeout=20)
    assert marker.read_text() == f"euid={NOBODY} argc=1\n", "memwatch executed the process's binary"
    assert watched.returncode in (0, 4), watched.stderr  # 4: no NVML here; either way nothing ran
    assert "Traceback" not in watched.stderr
    assert injected.returncode == 5
    assert injected.stderr == (f"error: process {pid} belongs to uid {NOBODY}, whose rings must live in that user's "
                               f"runtime directory; run memwatch as that user: sudo -u '#{NOBODY}' memwatch attach "
                               f"--inject {pid}\n")


def test_even_roots_own_python3_is_never_executed_to_learn_its_version(
        shared_dir: Path, tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    binary, marker = _recorder(shared_dir, 0)
    pid = _run_as(binary, 0, started, marker)
    env = target_env(tmp_path / "runtime", tmp_path / "db.sqlite")
    injected = memwatch(env, "attach", "--inject", str(pid), timeout=20)
    assert marker.read_text() == "euid=0 argc=1\n"
    assert injected.returncode == 2
    assert injected.stderr == (f"error: process {pid} runs {binary}, whose Python version could not be read from its "
                               "name or its bytes; --inject works on CPython 3.11 or newer\n")


def _static_python() -> Path | None:
    """The system's CPython when it is one file (Debian's is), so a copy of it runs anywhere."""
    found = shutil.which("python3", path="/usr/bin:/bin")
    if found is None:
        return None
    real = Path(os.path.realpath(found))
    return None if b"libpython" in real.read_bytes() else real


def test_a_static_interpreter_named_python3_has_its_version_read_from_its_bytes(
        tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    system = _static_python()
    if system is None:
        pytest.skip("this machine's python3 loads libpython, whose name already carries the version")
    probe = "import sys; print(*sys.version_info[:2])"
    expected = tuple(int(part) for part in subprocess.run([str(system), "-I", "-S", "-c", probe], capture_output=True,
                                                          text=True, timeout=30, check=True).stdout.split())
    interpreter = tmp_path / "python3"
    shutil.copy(system, interpreter)
    proc = subprocess.Popen([str(interpreter), "-I", "-S", "-c", "import time; time.sleep(30)"],
                            stdin=subprocess.DEVNULL)
    started.append(proc)
    wait_for(lambda: os.readlink(f"/proc/{proc.pid}/exe") == str(interpreter), timeout=10, what="the exec")
    assert python_target(proc.pid).version == expected


def test_a_gdb_another_user_planted_on_the_path_is_never_chosen(shared_dir: Path) -> None:
    planted = shared_dir / "gdb"
    planted.write_text("#!/bin/sh\nexit 0\n")
    planted.chmod(0o755)
    os.chown(planted, NOBODY, NOBODY)
    os.chown(shared_dir, NOBODY, NOBODY)
    system_gdb = shutil.which("gdb", path="/usr/local/bin:/usr/bin:/bin")
    assert trusted_tool("gdb", f"{shared_dir}:/usr/local/bin:/usr/bin:/bin") == os.path.realpath(system_gdb)
    assert trusted_tool("gdb", f".:{shared_dir}") is None
    shared_dir.chmod(0o777)
    os.chown(shared_dir, 0, 0)
    planted_by_root = shared_dir / "gdb"
    os.chown(planted_by_root, 0, 0)
    assert trusted_tool("gdb", str(shared_dir)) is None  # root's file, but in a folder anyone may write to


def _unreadable_executable() -> tuple[int, str] | None:
    """A process whose executable even root cannot name: pid 1 in some sandboxes, or a kernel thread."""
    for entry in sorted(Path("/proc").iterdir(), key=lambda path: (len(path.name), path.name)):
        if not entry.name.isdigit():
            continue
        try:
            os.readlink(entry / "exe")
        except PermissionError:
            return int(entry.name), "protected"
        except FileNotFoundError:
            if entry.exists():
                return int(entry.name), "kernel thread"
        except OSError:
            continue
    return None


def test_root_injecting_into_a_process_it_cannot_read_is_told_why_not_to_become_root() -> None:
    found = _unreadable_executable()
    if found is None:
        pytest.skip("every process on this machine has an executable root can read")
    pid, what = found
    done = subprocess.run([sys.executable, "-m", "memwatch", "attach", "--inject", str(pid)], capture_output=True,
                          text=True, timeout=30)
    assert "as root" not in done.stderr  # it is root already
    if what == "protected":
        assert (done.returncode, done.stderr) == (5, f"error: the kernel does not let memwatch read process {pid}'s "
                                                     "executable (a protected process, such as pid 1, a kernel thread "
                                                     "or one that is not dumpable); memwatch cannot inject into it\n")
    else:
        assert (done.returncode, done.stderr) == (2, f"error: process {pid} has no executable (a kernel thread); "
                                                     "--inject works on Python engines only\n")


def test_inject_with_an_option_it_refuses_injects_nothing(tmp_path: Path) -> None:
    runtime_dir, db_path = tmp_path / "runtime", tmp_path / "db.sqlite"
    runtime_dir.mkdir(mode=0o700)
    script = tmp_path / "loop.py"
    script.write_text(LIGHT)
    env = target_env(runtime_dir, db_path)
    target = Target(script, env)
    done = memwatch(env, "attach", str(target.proc.pid), "--inject", "--db", str(tmp_path / "other.sqlite"))
    out, err = target.finish()
    assert done.returncode == 2
    assert done.stderr == "error: --db only says where --record stores samples; add --record or drop --db\n"
    assert (out.splitlines()[-1], err) == ("threads ['MainThread']", "")
    assert not list(runtime_dir.glob("*.ring"))



@needs_gdb_calls
def test_gdb_runs_in_root_with_a_scrubbed_environment_and_loads_nothing_from_the_target(
        trusted_dir: Path, tmp_path: Path) -> None:
    system_gdb = shutil.which("gdb", path="/usr/local/bin:/usr/bin:/bin")
    seen = trusted_dir / "seen.txt"
    wrapper = trusted_dir / "gdb"  # root's own file in root's own folders up to /: trusted; it tells what gdb got
    wrapper.write_text(f'#!/bin/sh\n{{ env; echo "cwd=$(pwd)"; printf "arg=%s\\n" "$@"; }} > {seen}\n'
                       f'exec {system_gdb} "$@"\n')
    wrapper.chmod(0o755)
    runtime_dir, db_path = tmp_path / "runtime", tmp_path / "db.sqlite"
    runtime_dir.mkdir(mode=0o700)
    script = tmp_path / "loop.py"
    script.write_text(LIGHT)
    env = target_env(runtime_dir, db_path)
    target = Target(script, env)
    done = subprocess.run([sys.executable, "-m", "memwatch", "attach", "--inject", str(target.proc.pid), "--once"],
                          env={**env, "PATH": f"{trusted_dir}:{env['PATH']}", "LD_PRELOAD": "", "GDBHISTFILE": "x",
                               "PYTHONPATH": str(tmp_path)},
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    memwatch(env, "attach", "--detach", str(target.proc.pid), timeout=60)
    target.finish()
    assert done.returncode == 0, done.stderr
    lines = seen.read_text().splitlines()
    variables = {line.split("=", 1)[0] for line in lines if not line.startswith(("cwd=", "arg="))}
    assert variables <= {"PATH", "LC_ALL", "HOME", "PWD", "SHLVL", "_"}, variables  # the last three: /bin/sh's own
    assert "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in lines
    assert "cwd=/" in lines
    args = [line[4:] for line in lines if line.startswith("arg=")]
    assert {"-nx", "set auto-load off", "set debuginfod enabled off"} <= set(args)


def test_sys_remote_exec_runs_the_targets_interpreter_only_when_no_other_user_may_change_it(
        trusted_dir: Path, started: list[subprocess.Popen[bytes]]) -> None:
    system = _static_python()
    if system is None:
        pytest.skip("this machine's python3 loads libpython, so a copy of it does not run elsewhere")
    interpreter = trusted_dir / "python3"
    shutil.copy(system, interpreter)
    proc = subprocess.Popen([str(interpreter), "-I", "-S", "-c", "import time; time.sleep(30)"],
                            stdin=subprocess.DEVNULL)
    started.append(proc)
    wait_for(lambda: os.readlink(f"/proc/{proc.pid}/exe") == str(interpreter), timeout=10, what="the exec")
    other_version = CheckedTarget(proc.pid, str(interpreter), (3, 99))
    with remote_exec_interpreter(other_version) as opened:  # root's file in root's folders: the very file it runs
        assert opened.path == str(interpreter)
        assert os.fstat(opened.fd).st_ino == os.stat(f"/proc/{proc.pid}/exe").st_ino
    trusted_dir.chmod(0o777)
    with pytest.raises(UnavailableError, match="which another user may change"):
        remote_exec_interpreter(other_version)
