"""Fixtures shared by the whole suite: a private runtime directory and a database path per test."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest
from stuck_log import StuckLog

if TYPE_CHECKING:
    from podman.fixtures import Setup


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    return directory


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "memwatch.db"


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test may touch the user's real runtime directory or database, or start a stray sidecar."""
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(tmp_path / "default-run"))
    monkeypatch.setenv("MEMWATCH_DB", str(tmp_path / "default.db"))
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    monkeypatch.delenv("MEMWATCH_RUN_ID", raising=False)
    monkeypatch.delenv("MEMWATCH", raising=False)
    monkeypatch.setenv("MEMWATCH_WHERE", "0")  # the machine running the tests may be a container or a pod
    os.umask(0o022)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A plain process to watch: ``sleep 30``, asleep (done starting up) by the time the test gets it."""
    process = subprocess.Popen(["sleep", "30"])
    deadline = time.monotonic() + 5
    while psutil.Process(process.pid).status() != psutil.STATUS_SLEEPING:
        assert time.monotonic() < deadline, "sleep never went to sleep"
        time.sleep(0.01)
    yield process
    process.kill()
    process.wait()


@pytest.fixture(scope="session")
def gdb_calls() -> None:
    """Skip a test that injects through gdb where this machine's gdb cannot call into a process (its reason says why).

    That is gdb 13 on a CPU with AMX; there ``test_inject.py`` checks instead what ``attach --inject`` tells the user.
    """
    from injection import gdb_calls_work

    if not gdb_calls_work():
        pytest.skip("this machine's gdb cannot call into a process (gdb 13 on a CPU with AMX: the kernel refuses its "
                    "XSAVE write-back, \"Couldn't write extended state status\")")


class ShippedRuns:
    """Each shipped scenario simulated and stored once per test session, on first use (``runs[name]``: its
    database and run id); each in a database of its own, so that ``latest`` and ``runs`` see only it."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._stored: dict[str, tuple[Path, str]] = {}

    def __getitem__(self, name: str) -> tuple[Path, str]:
        if name not in self._stored:
            from stored_runs import store_scenario

            folder = self._root / name
            runtime = folder / "rt"
            runtime.mkdir(mode=0o700, parents=True)
            db = folder / "memwatch.db"
            self._stored[name] = (db, store_scenario(name, runtime, db, live=True))
        return self._stored[name]


@pytest.fixture(scope="session")
def shipped_runs(tmp_path_factory: pytest.TempPathFactory) -> ShippedRuns:
    """Every shipped scenario's stored run, simulated once for the whole session."""
    return ShippedRuns(tmp_path_factory.mktemp("shipped"))


@pytest.fixture(scope="module")
def long_prefill_stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The ``long_prefill`` scenario (ends ``oom``) stored by the real collector with the live detectors, once per
    test module: its database and run id, for the incident builder's tests to copy."""
    from stored_runs import store_scenario

    root = tmp_path_factory.mktemp("long_prefill")
    runtime = root / "run"
    runtime.mkdir(mode=0o700)
    db_path = root / "memwatch.db"
    return db_path, store_scenario("long_prefill", runtime, db_path, live=True)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A private state folder as a sidecar keeps one: its descriptor and path."""
    from memwatch_engine.dirfd import private_dir

    fd = private_dir(tmp_path / "state")
    yield fd, tmp_path / "state"
    os.close(fd)


@pytest.fixture
def quiet_db(long_prefill_stored: tuple[Path, str], tmp_path: Path) -> tuple[Path, str]:
    """A copy of the stored ``long_prefill`` run with no bundle owed: a builder has nothing to do until told."""
    from test_incident_trigger_rules import _sql, copy_of

    path = copy_of(long_prefill_stored[0], tmp_path / "memwatch.db")
    _sql(path, "DELETE FROM incidents")
    return path, long_prefill_stored[1]


@pytest.fixture(scope="module")
def built() -> Iterator[Setup]:
    """The podman images the container tests run (built once per test run); skipped, saying why, where podman
    cannot run containers."""
    from podman.fixtures import setup, write_timings

    made = setup()
    if isinstance(made, str):
        pytest.skip(made)
    yield made
    write_timings()


@pytest.fixture
def stuck_log() -> Iterator[StuckLog]:
    """The discovery thread held in its next log write (``memwatch.collector``) until the test sets ``gate``."""
    handler = StuckLog()
    logger = logging.getLogger("memwatch.collector")
    logger.addHandler(handler)
    yield handler
    handler.gate.set()
    logger.removeHandler(handler)
