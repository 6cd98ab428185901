"""Real processes for end-to-end tests: a ``memwatch serve`` sidecar, waiting helpers."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memwatch_engine.spawn import sidecar_running


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def query(db_path: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if not db_path.exists():
        return []
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return conn.execute(sql, params).fetchall()
    except sqlite3.OperationalError:  # schema not created yet
        return []
    finally:
        conn.close()


def memwatch_env(runtime_dir: Path, db_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "MEMWATCH_RUNTIME_DIR": str(runtime_dir), "MEMWATCH_DB": str(db_path),
           "MEMWATCH_SPAWN": "0", "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


class SidecarProcess:
    """``memwatch serve`` in a child process, started and stopped like a user would."""

    def __init__(self, runtime_dir: Path, db_path: Path, *extra_args: str) -> None:
        self.runtime_dir = runtime_dir
        self.db_path = db_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "memwatch", "serve", *extra_args],
            env=memwatch_env(runtime_dir, db_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        wait_for(lambda: sidecar_running(runtime_dir) or self.proc.poll() is not None, what="the sidecar's lock")
        if self.proc.poll() is not None:
            raise AssertionError(f"memwatch serve exited at start: {self.proc.stdout.read()}")

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        output, _ = self.proc.communicate(timeout=timeout)
        return output

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
