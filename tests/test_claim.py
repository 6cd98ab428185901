"""The claim on a runtime directory, in-process: real locks in real directories, and a real process standing in
for an auto-started sidecar (its command line reads ``memwatch serve``, so it may be signalled)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memwatch.errors import PermissionDeniedError
from memwatch.sidecar import claim as claim_module
from memwatch.sidecar.claim import SidecarRunning, claim
from memwatch.sidecar.sidecar_files import StateDir
from memwatch_engine.liveness import process_start_ticks
from memwatch_engine.runtime import PID_NAME, PRESENCE_NAME

STAND_IN = """
import os, signal, sys, time
from pathlib import Path
from memwatch.sidecar.sidecar_files import StateDir

state_dir, stays = Path(sys.argv[3]), sys.argv[4] == "stays"
state = StateDir(state_dir, os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY))
assert state.try_lock()
state.write_pid(auto=True)
asked = []
signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))
print("ready", flush=True)
said = 0
while not asked or stays:
    time.sleep(0.01)
    if len(asked) != said:
        said = len(asked)
        print(f"asked {said}", flush=True)
time.sleep(0.2)  # its last drain and commit
state.close()
print(f"asked {len(asked)}, stopped", flush=True)
"""
"""An auto-started sidecar as ``claim`` sees one: it holds the lock with ``PID START auto`` in the pid file, and
stops once asked (SIGTERM) or, ``stays``, never (it says how often it was asked)."""


@pytest.fixture
def runtime(runtime_dir: Path) -> Iterator[int]:
    fd = os.open(runtime_dir, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


@pytest.fixture
def quick_handover(monkeypatch: pytest.MonkeyPatch) -> None:
    """A take-over that waits 1.5 s at most, so a holder that never goes is given up on quickly."""
    monkeypatch.setattr(claim_module, "HANDOVER_WAIT_S", 1.5)


def _holder(state_dir: Path, runtime: int, pid_line: str | None = None) -> StateDir:
    """Another sidecar's hold on ``state_dir``: its lock, and the pid file it wrote (none when ``None``)."""
    state = StateDir(state_dir, runtime)
    assert state.try_lock()
    if pid_line is not None:
        (state_dir / PID_NAME).write_text(pid_line)
    return state


def _stand_in(state_dir: Path, stays: bool = False) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-", "memwatch", "serve", str(state_dir), "stays" if stays else "goes"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(STAND_IN)
    proc.stdin.close()
    assert proc.stdout.readline() == "ready\n"
    return proc


def _end(proc: subprocess.Popen[str]) -> str:
    """Kill the stand-in (if it still runs) and what it said."""
    proc.kill()
    assert proc.stdout is not None
    if proc.stdout.closed:
        return ""
    with proc.stdout:
        said = proc.stdout.read()
    proc.wait(timeout=10)
    return said


def _pid_file(state_dir: Path) -> str:
    return (state_dir / PID_NAME).read_text()


def test_a_free_directory_is_claimed_with_our_pid_published(runtime_dir: Path, runtime: int) -> None:
    for auto, suffix in ((False, ""), (True, " auto")):
        state, took_over_from = claim(runtime_dir, runtime, runtime_dir, auto=auto)
        try:
            assert took_over_from is None
            assert _pid_file(runtime_dir) == f"{os.getpid()} {process_start_ticks(os.getpid())}{suffix}\n"
            assert not StateDir(runtime_dir, runtime).try_lock()  # held: no other sidecar takes it
            assert not (runtime_dir / PRESENCE_NAME).exists()      # its own state directory needs no marker
        finally:
            state.close()


def test_a_state_directory_of_its_own_publishes_presence_in_the_runtime_directory(tmp_path: Path, runtime_dir: Path,
                                                                                  runtime: int) -> None:
    state, _ = claim(tmp_path / "state", runtime, runtime_dir, auto=False)
    try:
        assert (runtime_dir / PRESENCE_NAME).exists()
        assert _pid_file(tmp_path / "state").split()[0] == str(os.getpid())
    finally:
        state.close()
    assert not (runtime_dir / PRESENCE_NAME).exists()


def test_a_state_directory_others_may_enter_is_refused_saying_why(tmp_path: Path, runtime_dir: Path,
                                                                  runtime: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(PermissionDeniedError) as refused:
        claim(shared, runtime, runtime_dir, auto=False)
    assert str(refused.value) == (
        f"cannot use {shared} as the sidecar's state directory: mode 755 lets other users in; chmod 700 it; it must "
        "be a directory of the sidecar's user, mode 0700 (pass another with --state-dir)")


def test_a_sidecar_started_by_hand_is_never_displaced(runtime_dir: Path, runtime: int) -> None:
    holder = _holder(runtime_dir, runtime, "1 1\n")  # init's pid: a process that is not ours
    try:
        for auto in (False, True):
            started = time.monotonic()
            with pytest.raises(SidecarRunning) as running:
                claim(runtime_dir, runtime, runtime_dir, auto=auto)
            assert time.monotonic() - started < 5  # told at once, not after the take-over's wait
            assert str(running.value) == (f"a sidecar is already running for {runtime_dir} (pid 1); "
                                          "stop it first or pass another --runtime-dir")
        assert _pid_file(runtime_dir) == "1 1\n"  # left as it was
    finally:
        holder.close()


def test_an_auto_started_sidecar_never_displaces_another_even_an_auto_started_one(runtime_dir: Path,
                                                                                  runtime: int) -> None:
    proc = _stand_in(runtime_dir)
    try:
        with pytest.raises(SidecarRunning, match=rf"\(pid {proc.pid}\)"):
            claim(runtime_dir, runtime, runtime_dir, auto=True)
        assert proc.poll() is None  # never asked to stop
    finally:
        _end(proc)


def test_a_holder_with_no_pid_file_is_named_by_nobody(runtime_dir: Path, runtime: int, quick_handover: None) -> None:
    holder = _holder(runtime_dir, runtime)
    try:
        with pytest.raises(SidecarRunning) as running:
            claim(runtime_dir, runtime, runtime_dir, auto=True)
        assert str(running.value) == (f"a sidecar is already running for {runtime_dir}; "
                                      "stop it first or pass another --runtime-dir")
        with pytest.raises(SidecarRunning, match=r"already running for .*/run; stop it first"):
            claim(runtime_dir, runtime, runtime_dir, auto=False)  # waited for a pid file that never came
    finally:
        holder.close()


def test_an_auto_started_sidecar_is_asked_to_stop_and_its_lock_taken_once_it_has(runtime_dir: Path,
                                                                                 runtime: int) -> None:
    proc = _stand_in(runtime_dir)
    try:
        state, took_over_from = claim(runtime_dir, runtime, runtime_dir, auto=False)
        try:
            assert took_over_from == proc.pid
            assert proc.wait(timeout=20) == 0  # it stopped cleanly once asked
            assert _end(proc).splitlines()[-1] == "asked 1, stopped"
            assert _pid_file(runtime_dir).split()[0] == str(os.getpid())
        finally:
            state.close()
    finally:
        _end(proc)


def test_an_auto_started_sidecar_that_does_not_stop_is_asked_once_and_given_up_on(runtime_dir: Path, runtime: int,
                                                                                 quick_handover: None) -> None:
    proc = _stand_in(runtime_dir, stays=True)
    try:
        started = time.monotonic()
        with pytest.raises(SidecarRunning, match=rf"\(pid {proc.pid}\)"):
            claim(runtime_dir, runtime, runtime_dir, auto=False)
        assert 1.5 <= time.monotonic() - started < 10
        time.sleep(0.1)
    finally:
        output = _end(proc)
    assert output.splitlines()[-1] == "asked 1"  # one SIGTERM, not one every look


def test_a_stale_pid_file_is_never_signalled_and_the_lock_is_taken_once_free(runtime_dir: Path, runtime: int) -> None:
    # "PID START auto" of a sidecar long gone: its pid is now ours, with another start time
    holder = _holder(runtime_dir, runtime, f"{os.getpid()} {process_start_ticks(os.getpid()) + 1} auto\n")
    release = threading.Timer(0.3, holder.close)
    release.start()
    try:
        started = time.monotonic()
        state, took_over_from = claim(runtime_dir, runtime, runtime_dir, auto=False)
        waited = time.monotonic() - started
        state.close()
    finally:
        release.join(timeout=10)
    assert took_over_from is None  # nobody was asked to stop
    assert 0.3 <= waited < 1.0     # looked at every 50 ms: taken soon after it was let go


def test_a_lock_let_go_before_any_pid_file_is_taken(runtime_dir: Path, runtime: int) -> None:
    holder = _holder(runtime_dir, runtime)
    release = threading.Timer(0.3, holder.close)
    release.start()
    try:
        state, took_over_from = claim(runtime_dir, runtime, runtime_dir, auto=False)
        state.close()
    finally:
        release.join(timeout=10)
    assert took_over_from is None


def test_another_state_directory_serving_the_runtime_directory_is_refused_and_our_lock_let_go(
        tmp_path: Path, runtime_dir: Path, runtime: int) -> None:
    holder = _holder(runtime_dir, runtime)  # a sidecar whose state directory is the runtime directory
    try:
        with pytest.raises(SidecarRunning) as running:
            claim(tmp_path / "state", runtime, runtime_dir, auto=False)
        assert str(running.value) == (f"a sidecar with another state directory is already running for {runtime_dir}; "
                                      "stop it first or pass another --runtime-dir")
        again = StateDir(tmp_path / "state", runtime)
        assert again.try_lock()  # the refused claim let its lock go
        again.close()
        assert not (tmp_path / "state" / PID_NAME).exists() and not (runtime_dir / PRESENCE_NAME).exists()
    finally:
        holder.close()
