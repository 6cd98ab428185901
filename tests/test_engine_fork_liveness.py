"""A child made by libc's ``fork()`` (a C extension: Python's at-fork hooks do not run) must not keep a dead
engine alive: the writer's lock is the process's own, and fork never passes it on.

The engine is a real process writing a real ring; it forks through ``ctypes`` and is then SIGKILLed while its
child sleeps on. Seen from another pid namespace (where the pid says nothing), the lock alone must say the
writer is gone, and a real sidecar in a pid namespace of its own must end the run ``crashed``.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pods import Pod, Shape, namespaces_refused, wait_until

from memwatch.sidecar.collector import ALIVE_CHECK_S
from memwatch.sidecar.liveness import ring_writer_alive
from memwatch_engine.ring_reader import RingReader

from processes import memwatch_env, query

TESTS = str(Path(__file__).parent)
DEAD_WITHIN_S = 3.0
CHILD_SLEEPS_S = 20

ENGINE = """
import ctypes, os, sys, time
sys.path.insert(0, {tests!r})
from probes import ScriptedProbe
from memwatch_engine import Monitor
m = Monitor(engine="script", model="tiny", probe=ScriptedProbe(), spawn_sidecar=False, run_id={run_id!r})
assert m.enabled, "monitor off"
for _ in range(50):
    m.step("decode", num_seqs=1, num_tokens=1)
child = ctypes.CDLL(None).fork()  # libc's fork: no Python at-fork hook runs in the child
if child == 0:
    time.sleep({sleeps})
    os._exit(0)
print("ready", os.getpid(), child, flush=True)
while True:
    m.step("decode", num_seqs=1, num_tokens=1)
    time.sleep(0.002)
"""


def _start(runtime_dir: Path, db_path: Path, run_id: str) -> tuple[subprocess.Popen[str], int, int]:
    script = ENGINE.format(tests=TESTS, run_id=run_id, sleeps=CHILD_SLEEPS_S)
    proc = subprocess.Popen([sys.executable, "-c", script], env=memwatch_env(runtime_dir, db_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    readable, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if readable else "no output within 30 s"
    assert line.startswith("ready"), line
    _, pid, child = line.split()
    return proc, int(pid), int(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _end(proc: subprocess.Popen[str], child: int) -> None:
    for pid in (proc.pid, child):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


def test_the_lock_of_a_sigkilled_writer_goes_though_its_libc_forked_child_lives(
        runtime_dir: Path, db_path: Path) -> None:
    proc, pid, child = _start(runtime_dir, db_path, "cfork")
    try:
        reader = RingReader(runtime_dir / "cfork-r0.ring")
        header = reader.header
        elsewhere = {**header.meta, "pid_ns": 1}  # as a sidecar in another pid namespace sees it: the lock decides
        assert ring_writer_alive(reader.fileno(), header.writer_pid, header.writer_start, elsewhere) is True
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        started = time.monotonic()
        while ring_writer_alive(reader.fileno(), header.writer_pid, header.writer_start, elsewhere):
            assert time.monotonic() - started < DEAD_WITHIN_S, "a libc-forked child keeps the dead writer alive"
            time.sleep(0.02)
        took = time.monotonic() - started
        assert _alive(child), "the child should outlive the writer for this test to mean anything"
        reader.close()
        print(f"writer seen dead {took:.3f} s after SIGKILL, its forked child still running")
    finally:
        _end(proc, child)


REFUSED = namespaces_refused()


@pytest.fixture
def pod() -> Iterator[Pod]:
    base = Path(tempfile.mkdtemp(prefix="memwatch-pod-", dir="/tmp"))
    pod = Pod(base)
    try:
        yield pod
    finally:
        pod.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(REFUSED is not None, reason=REFUSED or "")
def test_a_sidecar_in_its_own_pid_namespace_marks_the_run_crashed_though_a_forked_child_lives(pod: Pod) -> None:
    pod.sidecar(Shape(pid_ns=True))  # it cannot see the engine's pids: only the lock can tell
    proc, pid, child = _start(pod.rings, pod.db_path, "cforkns")
    try:
        def status() -> str | None:
            rows = query(pod.db_path, "SELECT status FROM runs WHERE run_id = 'cforkns'")
            return rows[0][0] if rows else None

        wait_until(lambda: status() == "running", 30, "the run stored while the engine runs")
        os.kill(pid, signal.SIGKILL)
        took = wait_until(lambda: status() == "crashed", ALIVE_CHECK_S + CHILD_SLEEPS_S, "the run marked crashed")
        assert _alive(child)
        assert took <= ALIVE_CHECK_S + 1.0, took
        print(f"crashed {took:.2f} s after SIGKILL, its forked child still running")
    finally:
        _end(proc, child)
