"""What the `memwatch attach --inject` tests share: the target processes and the `memwatch` command they run."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mirrors.zero_code import MIRRORS

from processes import memwatch_env, query, wait_for

LIGHT = """
import sys, threading, time
from pathlib import Path

stop = Path(sys.argv[1])
print("ready", flush=True)
while not stop.exists():
    time.sleep(0.05)
print("threads", sorted(thread.name for thread in threading.enumerate()), flush=True)
"""


@functools.cache
def gdb_calls_work() -> bool:
    """Whether this machine's gdb can call a function in a process (the probe costs about a second, once).

    gdb 13 (Debian 12's) cannot on a CPU with AMX: it writes back an XSAVE area sized for older CPUs, which the
    kernel refuses whole ("Couldn't write extended state status"). Injection then cannot work on that machine,
    whatever memwatch does; the tests of injection need a gdb that can, and one test checks what a user is told
    where it cannot.
    """
    gdb = shutil.which("gdb")
    if gdb is None:
        return False
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdin=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        probe = subprocess.run([gdb, "-batch", "-nx", "-q", "-p", str(child.pid), "-ex", "call (int) getpid()"],
                               stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=60)
    finally:
        child.kill()
        child.wait(timeout=10)
    return f"= {child.pid}" in probe.stdout


needs_gdb_calls = pytest.mark.usefixtures("gdb_calls")
"""For tests that inject through gdb: the ``gdb_calls`` fixture (conftest) skips them where gdb cannot call."""


def memwatch(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memwatch", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def target_env(runtime_dir: Path, db_path: Path, **extra: str) -> dict[str, str]:
    env = memwatch_env(runtime_dir, db_path, PYTHONPATH=str(MIRRORS), **extra)
    for name in ("MEMWATCH", "MEMWATCH_RUN_ID"):
        env.pop(name, None)
    return env


class Target:
    """A script run as a real process that serves until a stop file appears; killed at the test's end."""

    def __init__(self, script: Path, env: dict[str, str], *args: str) -> None:
        self.stop = script.with_suffix(".stop")
        self.stop.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, str(script), *args, str(self.stop)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(self.proc)
        assert self.proc.stdout.readline() == "ready\n", self.proc.stderr.read()

    def finish(self) -> tuple[str, str]:
        self.stop.touch()
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err
        return "ready\n" + out, err

    def running(self) -> bool:
        return self.proc.poll() is None


started: list[subprocess.Popen[str]] = []
"""Every process a test started; :func:`reap` ends those still running."""


def reap() -> None:
    """End every process a test started that still runs (each test module calls it after each test)."""
    while started:
        proc = started.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def unattended(script: Path, env: dict[str, str], *args: str) -> tuple[str, str]:
    return Target(script, env, *args).finish()


def wait_for_engine_steps(db_path: Path, ranks: list[int], at_least: int, what: str) -> None:
    """Wait (60 s at most) until each of ``ranks``, and no other, has ``at_least`` engine steps stored."""
    steps = "SELECT rank, count(*) FROM samples WHERE step_kind IS NOT NULL GROUP BY rank"
    wait_for(lambda: [rank for rank, count in query(db_path, steps) if count >= at_least] == ranks,
             timeout=60, what=what)


def detach_and_wait(env: dict[str, str], pid: int, db_path: Path) -> None:
    """``memwatch attach --detach PID``, then wait for the run to be stored as detached."""
    detached = memwatch(env, "attach", "--detach", str(pid))
    assert detached.returncode == 0, detached.stderr
    wait_for(lambda: query(db_path, "SELECT status FROM runs") == [("detached",)], what="the run to end")
