"""``memwatch sim`` says whether its run was stored, and where: --db, MEMWATCH_SPAWN=0, an auto-started sidecar."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from memwatch_engine.runtime import PID_NAME

from processes import SidecarProcess, memwatch_env, query, wait_for


def _sim(runtime_dir: Path, db_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memwatch", "sim", "--scenario", "clean_chat", *args],
                          env=memwatch_env(runtime_dir, db_path, **env), capture_output=True, text=True, timeout=120)


def test_without_a_sidecar_and_spawn_off_it_says_how_to_store_the_run(runtime_dir: Path, db_path: Path) -> None:
    done = _sim(runtime_dir, db_path)  # memwatch_env sets MEMWATCH_SPAWN=0
    assert done.returncode == 0, done.stderr
    assert "not stored: no sidecar runs" in done.stdout and "`memwatch serve` stores the rings" in done.stdout
    assert "next: memwatch check" not in done.stdout
    assert list(runtime_dir.glob("*.ring"))  # left for a sidecar to store later


def test_db_is_where_the_sidecar_it_starts_stores_the_run(runtime_dir: Path, tmp_path: Path) -> None:
    chosen = tmp_path / "chosen.db"
    done = _sim(runtime_dir, tmp_path / "env.db", "--db", str(chosen), MEMWATCH_SPAWN="1")
    pid = int((runtime_dir / PID_NAME).read_text().split()[0]) if (runtime_dir / PID_NAME).exists() else None
    try:
        assert done.returncode == 0, done.stderr
        run_id = done.stdout.split()[1].rstrip(":")
        # The command returned only once the run was stored, in the database --db named.
        assert query(chosen, "SELECT status FROM runs WHERE run_id = ?", (run_id,)) == [("ok",)]
        assert not (tmp_path / "env.db").exists()
        assert f"stored by the sidecar (pid {pid})" in done.stdout
        assert f"exits after 60 s with nothing to store (kill {pid} stops it now)" in done.stdout
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text()
                     .lower(), what="the sidecar to stop")


def test_db_cannot_redirect_a_sidecar_that_already_runs(runtime_dir: Path, db_path: Path, tmp_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path):
        done = _sim(runtime_dir, db_path, "--db", str(tmp_path / "other.db"))
    assert done.returncode == 2
    assert done.stderr.startswith("error: a sidecar already runs for") and done.stderr.count("\n") == 1
