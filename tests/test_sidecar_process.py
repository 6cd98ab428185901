"""The sidecar as a real process: lock, clean stop with a final drain, auto-start from the plugin."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from memwatch_engine.liveness import process_start_ticks
from memwatch_engine.runtime import PID_NAME
from memwatch_engine.spawn import sidecar_running

from processes import SidecarProcess, memwatch_env, query, wait_for

ENGINE = """
import sys
sys.path.insert(0, {tests!r})
from probes import ScriptedProbe
from memwatch_engine import Monitor
m = Monitor(engine="script", model="tiny", probe=ScriptedProbe(), spawn_sidecar={spawn})
with m.phase("serve"):
    for i in range({steps}):
        m.step("decode", num_seqs=1, num_tokens=1)
m.close()
print(m.run_id)
"""
TESTS = str(Path(__file__).parent)


def _holder(pid_file: Path) -> list[str]:
    """The pid file's pid and, for an auto-started sidecar, "auto" (its start time, the middle field, left out)."""
    try:
        fields = pid_file.read_text().split()
    except OSError:
        return []
    return fields[:1] + fields[2:]


def _engine(runtime_dir: Path, db_path: Path, steps: int, spawn: bool, **env: str) -> str:
    script = ENGINE.format(tests=TESTS, spawn=spawn, steps=steps)
    out = subprocess.run([sys.executable, "-c", script], env=memwatch_env(runtime_dir, db_path, **env),
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_second_sidecar_is_refused_with_one_line(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        second = subprocess.run([sys.executable, "-m", "memwatch", "serve"], env=memwatch_env(runtime_dir, db_path),
                                capture_output=True, text=True, timeout=30)
        assert second.returncode == 4
        assert second.stderr.strip().splitlines()[-1].startswith("error: a sidecar is already running for ")
        assert f"(pid {sidecar.proc.pid})" in second.stderr
        sidecar.stop()


def test_a_sidecar_started_by_hand_takes_over_from_an_auto_started_one(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path, "--exit-when-idle", "600", "--quiet-if-running") as auto:
        pid_file = runtime_dir / PID_NAME  # written just after the lock is taken
        wait_for(lambda: _holder(pid_file) == [str(auto.proc.pid), "auto"],
                 what="the auto-started sidecar's pid file")
        auto.pause()  # the engine writes while the stand-in cannot read: the records wait in the ring
        run_id = _engine(runtime_dir, db_path, 5000, spawn=False)
        auto.resume()
        with SidecarProcess(runtime_dir, db_path) as by_hand:
            assert auto.proc.wait(timeout=60) == 0, auto.stop()  # asked to stop, it drained and exited cleanly
            wait_for(lambda: by_hand.proc.poll() is not None or _holder(pid_file) == [str(by_hand.proc.pid)],
                timeout=60, what="the hand-started sidecar's pid file")
            assert by_hand.proc.poll() is None, by_hand.stop()
            wait_for(lambda: query(db_path, "SELECT status FROM runs WHERE run_id = ?", (run_id,)) == [("ok",)],
                     what="the run stored")
            output = by_hand.stop()
    assert by_hand.proc.returncode == 0, output
    assert f"took over from the auto-started sidecar (pid {auto.proc.pid})" in output
    assert query(db_path, "SELECT count(*) FROM samples WHERE run_id = ?", (run_id,)) == [(5003,)]  # none twice


def test_a_stale_pid_file_naming_another_process_is_never_signalled(runtime_dir: Path, db_path: Path) -> None:
    # A killed auto-started sidecar leaves "PID START auto" behind; its pid may now be any process of ours, even
    # one whose command line reads "memwatch serve": only the start time the file recorded makes it that sidecar.
    bystander = subprocess.Popen([sys.executable, "-", "memwatch", "serve"], stdin=subprocess.PIPE)
    lock = os.open(runtime_dir / "sidecar.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.fcntl(lock, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))  # not a sidecar
        (runtime_dir / PID_NAME).write_text(f"{bystander.pid} {process_start_ticks(bystander.pid) + 1} auto\n")
        with SidecarProcess(runtime_dir, db_path) as by_hand:  # it starts while the lock is held
            time.sleep(1.0)  # it waits for the lock, and must not signal the bystander meanwhile
            assert bystander.poll() is None
            os.close(lock)
            lock = -1
            pid_file = runtime_dir / PID_NAME
            wait_for(lambda: _holder(pid_file) == [str(by_hand.proc.pid)], what="the lock taken")
            output = by_hand.stop()
        assert bystander.poll() is None and "took over" not in output
    finally:
        if lock >= 0:
            os.close(lock)
        bystander.kill()
        bystander.wait(timeout=30)
        assert bystander.stdin is not None
        bystander.stdin.close()


def test_an_auto_started_sidecar_never_displaces_one_started_by_hand(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as by_hand:
        pid_file = runtime_dir / PID_NAME
        wait_for(lambda: _holder(pid_file) == [str(by_hand.proc.pid)],
                 what="the hand-started sidecar's pid file")
        auto = subprocess.run([sys.executable, "-m", "memwatch", "serve", "--exit-when-idle", "60",
                               "--quiet-if-running"], env=memwatch_env(runtime_dir, db_path),
                              capture_output=True, text=True, timeout=30)
        assert auto.returncode == 0 and by_hand.proc.poll() is None
        assert _holder(pid_file) == [str(by_hand.proc.pid)]
        by_hand.stop()


def test_stop_drains_what_the_engine_wrote(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sidecar.pause()  # the engine writes while the sidecar cannot read
        run_id = _engine(runtime_dir, db_path, 5000, spawn=False)
        output = sidecar.stop()  # SIGCONT + SIGTERM: it must drain before exiting
    assert sidecar.proc.returncode == 0, output
    assert query(db_path, "SELECT count(*) FROM samples WHERE run_id = ?", (run_id,)) == [(5003,)]
    assert query(db_path, "SELECT status FROM runs") == [("ok",)]
    assert not (runtime_dir / PID_NAME).exists() and not list(runtime_dir.glob("*.ring"))


def test_plugin_starts_a_sidecar_when_none_runs(runtime_dir: Path, db_path: Path) -> None:
    assert not sidecar_running(runtime_dir)
    run_id = _engine(runtime_dir, db_path, 100, spawn=True, MEMWATCH_SPAWN="1")
    try:
        wait_for(lambda: query(db_path, "SELECT status FROM runs WHERE run_id = ?", (run_id,)) == [("ok",)],
                 what="the auto-started sidecar to store the run")
        assert sidecar_running(runtime_dir)
        assert query(db_path, "SELECT count(*) FROM samples") == [(103,)]
        log = (runtime_dir / "sidecar.log").read_text()
        assert "Traceback" not in log
    finally:
        pid_file = runtime_dir / PID_NAME
        pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text().split()[0], what="the sidecar pid file"))
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not sidecar_running(runtime_dir), what="the sidecar to stop")


def test_flags_are_stored_and_logged_live(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sim = subprocess.run([sys.executable, "-m", "memwatch", "sim", "--scenario", "non_torch_leak", "--json"],
                             env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=60)
        run_id = json.loads(sim.stdout)["run_id"]
        # The leak kills the simulated engine outside PyTorch: its ring is never closed, and the sidecar
        # marks the run crashed once the writer process is gone.
        wait_for(lambda: query(db_path, "SELECT status FROM runs WHERE run_id = ?", (run_id,)) == [("crashed",)],
                 what="the simulated crashed run to be stored")
        output = sidecar.stop()
    stored = query(db_path, "SELECT kind, severity, step FROM flags WHERE run_id = ? ORDER BY ts_ns", (run_id,))
    assert [kind for kind, _, _ in stored] == ["oom_risk", "non_torch_drift", "oom_risk"]
    for kind, _, step in stored:
        assert f"run {run_id} rank 0 step {step}: " in output and f"[{kind}]" in output


def test_one_sidecar_per_runtime_directory_whatever_its_state_directory(runtime_dir: Path, db_path: Path,
                                                                         tmp_path: Path) -> None:
    state = tmp_path / "state"
    with SidecarProcess(runtime_dir, db_path, "--state-dir", str(state)) as sidecar:
        assert (state / PID_NAME).is_file() and not (runtime_dir / PID_NAME).exists()
        assert sidecar_running(runtime_dir)  # engines see it by its marker in the runtime directory
        second = subprocess.run([sys.executable, "-m", "memwatch", "serve"], env=memwatch_env(runtime_dir, db_path),
                                capture_output=True, text=True, timeout=30)
        assert second.returncode == 4, second.stderr
        assert "a sidecar with another state directory is already running for" in second.stderr
        assert sidecar.stop() and sidecar.proc.returncode == 0
    assert not sidecar_running(runtime_dir) and not (runtime_dir / "sidecar.present").exists()
    assert (state.stat().st_mode & 0o777, state.stat().st_uid) == (0o700, os.getuid())
