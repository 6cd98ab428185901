"""How an engine process ends, as the sidecar records it: a return from ``main`` without ``Monitor.close()``
is a clean end, an uncaught exception an error, ``os._exit`` (which runs no Python) a crash.

Each engine is a real child process writing a real ring; a real ``memwatch serve`` stores it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from processes import SidecarProcess, memwatch_env, query, wait_for

TESTS = str(Path(__file__).parent)
STEPS = 300

ENGINE = """
import os, sys
sys.path.insert(0, {tests!r})
from probes import ScriptedProbe
from memwatch_engine import Monitor

def main():
    monitor = Monitor(engine="script", model="tiny", probe=ScriptedProbe(), spawn_sidecar=False, run_id={run_id!r})
    assert monitor.enabled, "monitor off"
    with monitor.phase("serve"):
        for _ in range({steps}):
            monitor.step("decode", num_seqs=1, num_tokens=1)
{ending}

main()
"""


def _engine(runtime_dir: Path, db_path: Path, run_id: str, ending: str) -> subprocess.CompletedProcess[str]:
    script = ENGINE.format(tests=TESTS, run_id=run_id, steps=STEPS, ending=ending)
    env = memwatch_env(runtime_dir, db_path, MEMWATCH="1", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)


def _ended(db_path: Path, run_id: str) -> tuple[str, str, int, dict[str, object] | None]:
    """(run status, rank status, decode samples, run_end data) once the run has ended."""
    def ended() -> tuple[str, str] | None:
        rows = query(db_path, "SELECT r.status, k.status FROM runs r JOIN ranks k USING (run_id) WHERE run_id = ?",
                     (run_id,))
        return rows[0] if rows and rows[0][0] != "running" else None

    run_status, rank_status = wait_for(ended, timeout=30, what=f"run {run_id} to end")
    samples = query(db_path, "SELECT count(*) FROM samples WHERE run_id = ? AND step_kind = 'decode'", (run_id,))
    data = query(db_path, "SELECT data FROM events WHERE run_id = ? AND kind = 'run_end'", (run_id,))
    return run_status, rank_status, samples[0][0], json.loads(data[0][0]) if data else None


def test_an_engine_that_returns_from_main_without_close_ends_ok(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path, "--poll-interval", "0.1") as sidecar:
        done = _engine(runtime_dir, db_path, "returned", "    return")
        assert done.returncode == 0, done.stderr
        assert _ended(db_path, "returned") == ("ok", "ok", STEPS, {"status": "ok", "closed_at_exit": True})
        sidecar.stop()


def test_sys_exit_is_a_clean_end_and_an_uncaught_exception_an_error(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path, "--poll-interval", "0.1") as sidecar:
        done = _engine(runtime_dir, db_path, "sysexit", "    sys.exit(0)")
        assert done.returncode == 0, done.stderr
        raised = _engine(runtime_dir, db_path, "raised", "    raise RuntimeError('engine bug')")
        assert raised.returncode == 1 and "engine bug" in raised.stderr
        assert _ended(db_path, "sysexit")[:3] == ("ok", "ok", STEPS)
        assert _ended(db_path, "raised") == ("error", "error", STEPS, {"status": "error", "closed_at_exit": True})
        sidecar.stop()


def test_os_exit_runs_no_hook_and_is_recorded_as_a_crash(runtime_dir: Path, db_path: Path) -> None:
    # Nothing in the process runs after os._exit: only its parent sees the exit status, not the sidecar.
    with SidecarProcess(runtime_dir, db_path, "--poll-interval", "0.1") as sidecar:
        done = _engine(runtime_dir, db_path, "osexit", "    os._exit(0)")
        assert done.returncode == 0, done.stderr
        assert _ended(db_path, "osexit") == ("crashed", "crashed", STEPS, None)
        sidecar.stop()


def test_an_explicit_close_is_not_repeated_at_exit(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path, "--poll-interval", "0.1") as sidecar:
        done = _engine(runtime_dir, db_path, "closed", "    monitor.close('ok')\n    monitor.close('error')")
        assert done.returncode == 0, done.stderr
        assert _ended(db_path, "closed") == ("ok", "ok", STEPS, {"status": "ok"})
        assert query(db_path, "SELECT count(*) FROM events WHERE run_id = 'closed' AND kind = 'run_end'") == [(1,)]
        sidecar.stop()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_forked_child_that_exits_does_not_end_its_parents_run(runtime_dir: Path, db_path: Path) -> None:
    ending = ("    pid = os.fork()\n"
              "    if pid == 0:\n"
              "        sys.exit(0)  # the child's interpreter exits: its exit hook must leave the parent's ring\n"
              "    os.waitpid(pid, 0)\n"
              f"    for _ in range({STEPS}):\n"
              "        monitor.step('decode', num_seqs=1, num_tokens=1)\n"
              "    monitor.close()")
    with SidecarProcess(runtime_dir, db_path, "--poll-interval", "0.1") as sidecar:
        done = _engine(runtime_dir, db_path, "forked", ending)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr and "turned off" not in done.stderr, done.stderr
        assert _ended(db_path, "forked") == ("ok", "ok", 2 * STEPS, {"status": "ok"})
        sidecar.stop()
