"""The injection checks on real processes at the edges the simpler tests do not reach: a process whose uids
disagree among themselves, a tracer that lacks CAP_SYS_PTRACE (its own capability word read from /proc), a Python
already being traced, an interpreter known only by the libpython it maps, and a process memwatch already records."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memwatch.attach.inject_checks import Target, check_all, check_ptrace, check_user, inject_hint, python_target
from memwatch.errors import PermissionDeniedError, UnavailableError

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing a process's uids and capabilities needs root")
Start = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def start() -> Iterator[Start]:
    """Start a Python child that runs ``code``, prints ``ready`` and waits for its stdin to close."""
    procs: list[subprocess.Popen[str]] = []

    def run(code: str, argv: list[str] | None = None, **popen: object) -> subprocess.Popen[str]:
        args = [*(argv or [sys.executable]), "-c", code + "\nimport sys; print('ready', flush=True); sys.stdin.read()"]
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,  # type: ignore[call-overload]
                                **popen)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        return proc

    yield run
    for proc in procs:
        proc.kill()  # SIGKILL: a traced child would stop on any other signal instead of ending
        proc.communicate(timeout=30)


@as_root
@pytest.mark.parametrize(("uids", "other"), [
    ((0, NOBODY, 0), NOBODY),  # effective differs from real and saved
    ((0, 0, NOBODY), NOBODY),  # only the saved uid differs: the process could take it back at any moment
])
def test_a_process_with_any_uid_not_ours_is_refused_naming_that_uid(
        start: Start, uids: tuple[int, int, int], other: int) -> None:
    proc = start(f"import os; os.setresuid{uids}")
    with pytest.raises(PermissionDeniedError, match=f"belongs to uid {other}, whose rings"):
        check_user(proc.pid)  # as root: the rings must be that user's
    with pytest.raises(PermissionDeniedError) as refused:
        check_user(proc.pid, euid=NOBODY)  # as the other user: the real uid 0 is not theirs
    assert str(refused.value) == (f"process {proc.pid} belongs to uid 0, not to you (uid {NOBODY}); run memwatch "
                                  "attach --inject as that user or as root")


@as_root
@pytest.mark.parametrize("scope", ["1", "2"])
def test_a_tracer_without_cap_sys_ptrace_is_refused_from_its_own_capability_word(tmp_path: Path, scope: str) -> None:
    # setpriv drops CAP_SYS_PTRACE (bit 19) from the bounding set, so root's child runs with every capability but
    # that one: its CapEff is hex 1fffef7ffff (bits 19 and 24 clear), which must be read in base 16 — read in any
    # other base the word would claim bit 19.
    yama = tmp_path / "ptrace_scope"
    yama.write_text(scope)
    code = ("import os, sys; from pathlib import Path; from memwatch.attach.inject_checks import check_ptrace\n"
            "from memwatch.errors import PermissionDeniedError\n"
            "cap = next(l for l in open('/proc/self/status') if l.startswith('CapEff:')).split()[1]\n"
            "print(int(cap, 16) >> 19 & 1)\n"
            "try:\n    check_ptrace(os.getpid(), yama_path=Path(sys.argv[1]))\n    print('allowed')\n"
            "except PermissionDeniedError as e:\n    print('refused:', e)\n")
    setpriv = shutil.which("setpriv")
    assert setpriv is not None, "setpriv (util-linux) is needed: make test-deps installs it"
    result = subprocess.run([setpriv, "--bounding-set", "-sys_ptrace", "--inh-caps", "-sys_ptrace", "--",
                             sys.executable, "-c", code, str(yama)], capture_output=True, text=True, timeout=60)
    bit, verdict = result.stdout.splitlines()
    assert bit == "0", result.stderr
    assert verdict.startswith("refused:") and f"{yama} is {scope}" in verdict
    check_ptrace(os.getpid(), yama_path=yama)  # this process keeps the capability: allowed under both scopes


def test_a_python_already_being_traced_is_refused_by_check_all_with_its_tracer(start: Start) -> None:
    # PTRACE_TRACEME (request 0) makes this test's process the child's tracer, as a debugger attached to it would be.
    proc = start("import ctypes; assert ctypes.CDLL(None, use_errno=True).ptrace(0, 0, 0, 0) == 0")
    assert f"TracerPid:\t{os.getpid()}\n" in Path(f"/proc/{proc.pid}/status").read_text()
    with pytest.raises(UnavailableError) as refused:
        check_all(proc.pid)
    assert str(refused.value) == (f"process {proc.pid} is already being traced by process {os.getpid()} (a "
                                  "debugger?); detach that first")


def _mapped_libpython() -> tuple[str, tuple[int, int]] | None:
    found = re.search(r"(\S*/libpython(\d+)\.(\d+)[^/\s]*\.so\S*)", Path("/proc/self/maps").read_text())
    return (found.group(1), (int(found.group(2)), int(found.group(3)))) if found else None


@pytest.mark.skipif(_mapped_libpython() is None, reason="this interpreter is built without a shared libpython")
def test_an_interpreter_named_otherwise_is_known_by_the_libpython_it_maps(start: Start, tmp_path: Path) -> None:
    # An embedding engine (a binary called "engine") runs CPython through libpython: its name carries no
    # version, so the version must come from the library it maps.
    mapped = _mapped_libpython()
    assert mapped is not None
    _, version = mapped
    engine = tmp_path / "engine"
    engine.write_bytes(Path(os.path.realpath(sys.executable)).read_bytes())
    engine.chmod(0o755)
    proc = start("pass", argv=[str(engine)], env={**os.environ, "PYTHONHOME": sys.base_prefix})
    assert python_target(proc.pid) == Target(pid=proc.pid, exe=str(engine), version=version)


def test_no_hint_for_a_process_memwatch_already_records(
        start: Start, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime))
    tests = str(Path(__file__).parent)
    recorded = start(f"import sys; sys.path.insert(0, {tests!r}); from probes import ScriptedProbe\n"
                     "from memwatch_engine import Monitor\n"
                     f"m = Monitor(engine='e', probe=ScriptedProbe(), runtime_dir={str(runtime)!r}, "
                     "spawn_sidecar=False, run_id='hinted'); assert m.enabled; m.step('decode', num_seqs=1)")
    assert sorted(path.name for path in runtime.iterdir() if path.suffix == ".ring") == ["hinted-r0.ring"]
    assert inject_hint(recorded.pid) is None
    plain = start("pass")  # the same kind of process with no ring gets the hint
    assert inject_hint(plain.pid) is not None


def test_a_hidden_executable_is_another_users_by_its_real_uid_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # Real uid 1001, the others 1000 (a setuid program run by 1001): to a caller of uid 1000 the process is
    # another user's, and the sentence says so, not that the kernel protects it. Seams: as root nothing is
    # refused to us, so the kernel's refusal and the ids are stood in for, for pid 4242 alone.
    from memwatch.attach import inject_checks

    ids = [1001, 1000, 1000, 1000]
    monkeypatch.setattr(inject_checks, "process_ids", lambda pid: (ids, ids) if pid == 4242 else ([], []))
    monkeypatch.setattr(inject_checks.os, "readlink", lambda path: (_ for _ in ()).throw(PermissionError(13, "no")))
    monkeypatch.setattr(inject_checks.os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionDeniedError) as refused:
        python_target(4242)
    assert str(refused.value) == ("cannot inspect process 4242: it belongs to another user; run memwatch as that "
                                  "user (or as root)")
