"""A ``memwatch serve`` run the way a pod runs it, for the incident tests: in a mount namespace of its own where
``/tmp`` and ``/var/tmp`` are read-only (a read-only root file system with no writable ``/tmp``), optionally with
its state directory on a small tmpfs; and a simulated engine that crashes while serving."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from processes import memwatch_env, query, sidecar_running, wait_for

READ_ONLY_TMP = ("mount --rbind /tmp /tmp; mount -o remount,bind,ro /tmp;"
                 " mount --bind /var/tmp /var/tmp; mount -o remount,bind,ro /var/tmp; cd /tmp")


def namespaces_or_skip() -> None:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("unshare(1) or nsenter(1) is missing")
    probe = subprocess.run(["unshare", "-m", "sh", "-ec", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no mounts in a mount namespace here: {probe.stderr.strip()}")


class PodSidecar:
    """``memwatch serve ARGS`` with ``TMPDIR`` unusable and ``/tmp`` read-only; ``writable`` stay writable (bind
    mounted before ``/tmp`` is made read-only); ``tmpfs`` (path, bytes) is mounted first, a small volume."""

    def __init__(self, runtime_dir: Path, db_path: Path, *args: str, writable: tuple[Path, ...] = (),
                 tmpfs: tuple[Path, int] | None = None, env: dict[str, str] | None = None) -> None:
        self.runtime_dir = runtime_dir
        steps = [f"mount --bind {shlex.quote(str(path))} {shlex.quote(str(path))};" for path in writable]
        if tmpfs is not None:
            steps.append(f"mount -t tmpfs -o size={tmpfs[1]},mode=0700 tmpfs {shlex.quote(str(tmpfs[0]))};")
        script = " ".join(steps) + READ_ONLY_TMP + '; exec "$@"'
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-ec", script, "sh", sys.executable, "-m",
             "memwatch", "serve", *args],
            env=memwatch_env(runtime_dir, db_path, TMPDIR="/nonexistent/tmp", **(env or {})),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: sidecar_running(runtime_dir) or self.proc.poll() is not None, what="the sidecar's lock")
        if self.proc.poll() is not None:
            raise AssertionError(f"memwatch serve exited at start: {self.proc.stdout.read()}")  # type: ignore[union-attr]

    def inside(self, command: str) -> subprocess.CompletedProcess[str]:
        """Run ``command`` (sh) in the sidecar's mount namespace: where its tmpfs is."""
        return subprocess.run(["nsenter", "-t", str(self.proc.pid), "-m", "sh", "-c", command], capture_output=True,
                              text=True, timeout=60)

    def kill(self) -> str:
        self.proc.send_signal(signal.SIGKILL)
        out, _ = self.proc.communicate(timeout=30)
        return out

    def stop(self, timeout: float = 60.0) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        out, _ = self.proc.communicate(timeout=timeout)
        return out

    def __enter__(self) -> PodSidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def crash_an_engine(runtime_dir: Path, db_path: Path) -> str:
    """A simulated engine that serves, then is SIGKILLed: its run ends ``crashed``; its run id."""
    before = {row[0] for row in query(db_path, "SELECT run_id FROM runs")} if db_path.exists() else set()

    def new_run() -> list[tuple[object, ...]]:
        return [row for row in query(db_path, "SELECT run_id, status FROM runs") if row[0] not in before] \
            if db_path.exists() else []

    engine = subprocess.Popen([sys.executable, "-m", "memwatch", "sim", "--scenario", "clean_chat", "--speed", "2"],
                              env=memwatch_env(runtime_dir, db_path), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        [(run_id, _)] = wait_for(new_run, timeout=60, what="the engine's run")
        wait_for(lambda: query(db_path, "SELECT 1 FROM samples WHERE run_id = ? AND phase = 'serve' LIMIT 1"
                                        " OFFSET 30", (run_id,)), timeout=60, what="the engine to serve")
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait(10)
    wait_for(lambda: query(db_path, "SELECT 1 FROM runs WHERE run_id = ? AND status = 'crashed'", (run_id,)),
             timeout=60, what="the run's crashed ending")
    return str(run_id)


def bundles_in(folder: Path) -> list[str]:
    """Whole bundles in ``folder``, not a ``file://`` upload's staging copy (``NAME.tar.gz#1``, renamed when done)."""
    return sorted(name for name in os.listdir(folder) if name.startswith("memwatch-incident-")
                  and name.endswith(".tar.gz")) if folder.exists() else []


ERROR_RUNS = """
import sys, time
sys.path.insert(0, {tests!r})
from probes import ScriptedProbe
from memwatch_engine import Monitor

for run_id in {run_ids!r}:
    monitor = Monitor(engine="script", model="tiny", probe=ScriptedProbe(), spawn_sidecar=False, run_id=run_id)
    assert monitor.enabled, "monitor off"
    with monitor.phase("serve"):
        for _ in range({steps}):
            monitor.step("decode", num_seqs=1, num_tokens=1)
    monitor.close({ending!r})
    time.sleep({pause})
"""

SERVING = """
import sys, time
sys.path.insert(0, {tests!r})
from probes import ScriptedProbe
from memwatch_engine import Monitor

monitor = Monitor(engine="script", model="tiny", probe=ScriptedProbe(), spawn_sidecar=False, run_id={run_id!r})
assert monitor.enabled, "monitor off"
with monitor.phase("serve"):
    for _ in range(12000):  # at most two minutes; killed long before
        monitor.step("decode", num_seqs=1, num_tokens=1)
        time.sleep(0.01)
"""


def end_runs_in_error(runtime_dir: Path, db_path: Path, run_ids: list[str], *, steps: int = 50,
                      pause_s: float = 0.0) -> None:
    """One engine process (the test's uid) that writes ``run_ids`` one after the other, each ``steps`` decode steps
    long and closed ``error``; returns once the sidecar has stored every ending."""
    script = ERROR_RUNS.format(tests=str(Path(__file__).parent), run_ids=run_ids, steps=steps, ending="error",
                               pause=pause_s)
    done = subprocess.run([sys.executable, "-c", script], env=memwatch_env(runtime_dir, db_path, MEMWATCH="1"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    marks = ",".join("?" * len(run_ids))
    wait_for(lambda: query(db_path, f"SELECT count(*) FROM runs WHERE status = 'error' AND run_id IN ({marks})",
                           tuple(run_ids))[0][0] == len(run_ids), timeout=60, what="the runs' error endings")


def serving_engine(runtime_dir: Path, db_path: Path, run_id: str) -> subprocess.Popen[bytes]:
    """An engine process whose run ``run_id`` is still being served (stepping every 10 ms), once it is stored."""
    script = SERVING.format(tests=str(Path(__file__).parent), run_id=run_id)
    engine = subprocess.Popen([sys.executable, "-c", script], env=memwatch_env(runtime_dir, db_path, MEMWATCH="1"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: query(db_path, "SELECT 1 FROM samples WHERE run_id = ? LIMIT 1", (run_id,)), timeout=60,
             what=f"run {run_id} stored")
    return engine
