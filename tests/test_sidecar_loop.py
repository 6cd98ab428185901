"""``memwatch serve``'s loop in process (:class:`memwatch.sidecar.daemon.Sidecar`): what ``/readyz`` says of the rings
stored and refused, the one line said when no ring arrives, the exit of an auto-started sidecar left idle, the last
drain at a stop, a store writer that stopped under it, and what the exporters are fed. Real rings, a real store and
writer, the loop in a thread."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memwatch.errors import UnavailableError
from memwatch.export.config import ExportConfig
from memwatch.export.pipeline import Exporters
from memwatch.export.prometheus import render
from memwatch.sidecar.daemon import Sidecar, _each
from memwatch_engine.ring import RingWriter


def _until(predicate: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class Loop:
    """The sidecar's ``run()`` in a thread; what ended it is kept."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self.failed: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="sidecar-under-test")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.sidecar.run()
        except BaseException as exc:  # what ended the loop is the finding
            self.failed.append(exc)

    def stop(self) -> None:
        began = time.monotonic()
        self.sidecar.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert time.monotonic() - began < 3.0  # the discovery thread stops within its scan interval


@pytest.fixture
def started(runtime_dir: Path, db_path: Path, tmp_path: Path) -> Iterator[Sidecar]:
    sidecar = Sidecar(runtime_dir, db_path, detect=False, state_dir=tmp_path / "state")
    sidecar.start()
    yield sidecar
    sidecar.close()


def _ring(runtime_dir: Path, run_id: str) -> RingWriter:
    return RingWriter(runtime_dir / f"{run_id}-r0.ring", run_id=run_id, meta={"engine": "raw"})


def _refused(path: Path, mode: int = 0o644) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    os.chmod(path, mode)


def test_readiness_counts_the_rings_stored_and_says_why_the_others_are_refused(runtime_dir: Path,
                                                                              started: Sidecar) -> None:
    started.heartbeat = time.monotonic()
    assert started.health() == (True, True, "ready; 0 rings being stored")
    one = _ring(runtime_dir, "one")
    started.collector.scan()
    assert started.readiness() == "ready; 1 ring being stored"
    two = _ring(runtime_dir, "two")
    _refused(runtime_dir / "open-r0.ring")
    started.collector.scan()
    assert started.readiness() == "ready; 2 rings being stored; 1 refused: other users may write or read it"
    (runtime_dir / "dir-r0.ring").mkdir(mode=0o700)
    started.collector.scan()
    assert started.health() == (True, True, "ready; 2 rings being stored; 2 refused: 1 other users may write or "
                                             "read it, 1 not a regular file")
    one.close()
    two.close()


def test_no_ring_in_time_is_said_once_with_the_refused_and_readiness_says_it_until_one_arrives(
        runtime_dir: Path, db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _refused(runtime_dir / "open-r0.ring")
    sidecar = Sidecar(runtime_dir, db_path, detect=False, state_dir=tmp_path / "state", poll_interval=0.05,
                      scan_interval=0.05, no_ring_after=1.0)
    sidecar.start()
    with caplog.at_level(logging.WARNING, logger="memwatch.serve"):
        loop = Loop(sidecar)
        try:
            _until(lambda: any(m.startswith("no ring has arrived") for m in caplog.messages))
            began = time.monotonic()
            assert sidecar.readiness() == ("ready; 0 rings being stored; 1 refused: other users may write or read it; "
                                           "no ring has arrived in 1 s")
            time.sleep(0.3)  # several rounds of the loop: the line is not said again
            ring = _ring(runtime_dir, "late")
            _until(lambda: sidecar.collector.rings)
            assert sidecar.readiness() == "ready; 1 ring being stored; 1 refused: other users may write or read it"
            assert time.monotonic() - began < 10
        finally:
            loop.stop()
    assert not loop.failed, loop.failed
    assert [m for m in caplog.messages if m.startswith("no ring")] == [
        f"no ring has arrived in {runtime_dir} in 1 s (1 refused: other users may write or read it); an engine is "
        "stored only when its MEMWATCH_RUNTIME_DIR names this directory (a private /tmp or another XDG_RUNTIME_DIR "
        "hides it) and its uid is trusted (--trust-uid)"]
    ring.close()


def test_no_ring_is_not_said_before_its_time_nor_once_a_ring_was_seen(
        runtime_dir: Path, db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sidecar = Sidecar(runtime_dir, db_path, detect=False, state_dir=tmp_path / "state", poll_interval=0.05,
                      scan_interval=0.05, no_ring_after=1.0)
    sidecar.start()
    ring = _ring(runtime_dir, "early")
    with caplog.at_level(logging.WARNING, logger="memwatch.serve"):
        loop = Loop(sidecar)
        try:
            _until(lambda: sidecar.collector.rings)
            ring.close()
            _until(lambda: not sidecar.collector.rings)  # stored and gone: no ring now, one was seen
            time.sleep(1.3)
            assert sidecar.readiness() == "ready; 0 rings being stored"
        finally:
            loop.stop()
    assert not loop.failed, loop.failed
    assert not [m for m in caplog.messages if m.startswith("no ring")]


def test_an_idle_auto_started_sidecar_exits_by_itself_after_storing_what_it_found(
        runtime_dir: Path, db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ring = _ring(runtime_dir, "idle")
    for step in range(5):
        ring.write_sample(step, 1000 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    ring.write_event(5, 1005, "run_end", {"status": "ok"})
    ring.close()
    sidecar = Sidecar(runtime_dir, db_path, detect=False, state_dir=tmp_path / "state", poll_interval=0.05,
                      scan_interval=0.05, exit_when_idle=0.4)
    sidecar.start()
    with caplog.at_level(logging.INFO, logger="memwatch.serve"):
        began = time.monotonic()
        loop = Loop(sidecar)
        loop.thread.join(30)
    assert not loop.thread.is_alive() and not loop.failed, loop.failed
    assert 0.4 <= time.monotonic() - began < 10
    assert "no engine has written for 0 s; exiting" in caplog.messages
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT status, records FROM ranks WHERE run_id = 'idle'").fetchone() == ("ok", 6)
    assert "idle-r0.ring" not in os.listdir(runtime_dir)  # stored whole: removed


def test_what_a_ring_holds_at_the_stop_is_drained_before_the_sidecar_exits(
        runtime_dir: Path, db_path: Path, tmp_path: Path) -> None:
    sidecar = Sidecar(runtime_dir, db_path, detect=False, state_dir=tmp_path / "state", poll_interval=5.0,
                      scan_interval=0.05)
    sidecar.start()
    ring = _ring(runtime_dir, "last")
    loop = Loop(sidecar)
    try:
        _until(lambda: sidecar.collector.rings and sidecar.heartbeat)
        for step in range(7):  # the loop waits 5 s for a batch: only the stop's last drain reads these
            ring.write_sample(step, 1000 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    finally:
        loop.stop()
    assert not loop.failed, loop.failed
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT records, status FROM ranks WHERE run_id = 'last'").fetchone() == (7, "running")
    ring.close()


def test_a_store_writer_that_stopped_ends_the_loop_saying_the_records_wait_in_the_rings(
        runtime_dir: Path, db_path: Path, tmp_path: Path) -> None:
    sidecar = Sidecar(runtime_dir, db_path, detect=False, state_dir=tmp_path / "state", poll_interval=0.05,
                      scan_interval=0.05)
    sidecar.start()
    loop = Loop(sidecar)
    _until(lambda: sidecar.heartbeat)
    sidecar.writer.close()
    loop.thread.join(30)
    assert not loop.thread.is_alive()
    [failure] = loop.failed
    assert isinstance(failure, UnavailableError)
    assert str(failure) == ("the store writer stopped: None; records stay in the rings for the next sidecar to "
                            "store")
    assert sidecar.health()[:2] == (False, False)


def test_a_database_locked_by_another_writer_is_not_ready_until_it_takes_records_again(
        runtime_dir: Path, db_path: Path, started: Sidecar) -> None:
    ring = _ring(runtime_dir, "wait")
    started.heartbeat = time.monotonic()
    other = sqlite3.connect(db_path, isolation_level=None)
    try:
        other.execute("BEGIN EXCLUSIVE")  # another process writing, for as long as it likes
        started.collector.scan()
        ring.write_sample(0, 1000, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        started.collector.poll()
        _until(lambda: started.writer.paused is not None)
        assert started.health() == (True, False, "the database is not taking records (database is locked); they "
                                                 "wait in the rings")
        other.execute("COMMIT")
        assert started.writer.flush(timeout=60)
        assert started.health() == (True, True, "ready; 1 ring being stored")
    finally:
        other.close()
        ring.close()


def test_a_sidecar_not_yet_started_is_alive_not_ready_and_would_store_no_ring(runtime_dir: Path, db_path: Path,
                                                                             tmp_path: Path) -> None:
    sidecar = Sidecar(runtime_dir, db_path, detect=False, state_dir=tmp_path / "state")
    try:
        assert sidecar.health() == (True, False, "starting")
        assert sidecar.readiness() == "ready; 0 rings being stored"
    finally:
        sidecar.close()


def test_a_loop_that_has_not_come_round_for_30_s_is_dead_by_default(started: Sidecar) -> None:
    started.heartbeat = time.monotonic() - 29.5
    assert started.health()[:2] == (True, True)
    started.heartbeat = time.monotonic() - 30.5
    assert started.health() == (False, False, "the sidecar's loop has not come round for 30 s")


def test_no_ring_in_time_with_none_refused_is_said_without_a_count(
        runtime_dir: Path, db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sidecar = Sidecar(runtime_dir, db_path, detect=False, state_dir=tmp_path / "state", poll_interval=0.05,
                      scan_interval=0.05, no_ring_after=0.3)
    sidecar.start()
    with caplog.at_level(logging.WARNING, logger="memwatch.serve"):
        loop = Loop(sidecar)
        try:
            _until(lambda: any(m.startswith("no ring has arrived") for m in caplog.messages))
            assert sidecar.readiness() == "ready; 0 rings being stored; no ring has arrived in 0 s"
        finally:
            loop.stop()
    assert [m for m in caplog.messages if m.startswith("no ring")] == [
        f"no ring has arrived in {runtime_dir} in 0 s; an engine is stored only when its MEMWATCH_RUNTIME_DIR names "
        "this directory (a private /tmp or another XDG_RUNTIME_DIR hides it) and its uid is trusted (--trust-uid)"]


def test_a_flag_reaches_the_exporters_and_the_incident_triggers_each_whichever_are_running() -> None:
    heard: list[tuple[str, object]] = []

    def exporters(flag: object) -> None:
        heard.append(("exporters", flag))

    def triggers(flag: object) -> None:
        heard.append(("triggers", flag))

    assert _each(None, None) is None  # nothing to tell: the detectors are not asked to call anything
    assert _each(exporters, None) is exporters and _each(None, triggers) is triggers  # one: called as it is
    both = _each(exporters, triggers)
    assert both is not None
    both("flag")
    assert heard == [("exporters", "flag"), ("triggers", "flag")]


def test_a_first_signal_stops_the_loop_and_a_second_exits_at_once_with_its_number(started: Sidecar) -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    started.heartbeat = time.monotonic()
    try:
        started.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGTERM)
        _until(lambda: not started.health()[1])
        assert started.health() == (True, False, "stopping: draining the rings")
        with pytest.raises(SystemExit) as exited:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs before this ends
        assert exited.value.code == 128 + signal.SIGINT == 130
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _descriptors() -> set[str]:
    gc.collect()  # what earlier tests left to the garbage collector
    return set(os.listdir("/proc/self/fd"))


def test_a_sidecar_closed_twice_leaves_no_descriptor_behind(runtime_dir: Path, db_path: Path, tmp_path: Path) -> None:
    first = Sidecar(runtime_dir, db_path, detect=False, state_dir=tmp_path / "state")
    first.start()  # what opens once in a process (and stays) is opened now
    first.close()
    del first
    open_before = _descriptors()
    sidecar = Sidecar(runtime_dir, db_path, detect=False, state_dir=tmp_path / "state")
    sidecar.start()
    sidecar.close()
    sidecar.close()  # as the loop's end and then its caller do: nothing closed twice
    del sidecar
    assert _descriptors() == open_before


def test_the_exporters_are_fed_the_records_read_the_records_lost_and_the_rings_refused(
        runtime_dir: Path, db_path: Path, tmp_path: Path) -> None:
    exporters = Exporters(ExportConfig())
    sidecar = Sidecar(runtime_dir, db_path, state_dir=tmp_path / "state", exporters=exporters)
    sidecar.start()
    ring = RingWriter(runtime_dir / "lap-r1.ring", run_id="lap", rank=1, world_size=2, meta={"engine": "raw"},
                      capacity=64)
    try:
        for step in range(100):  # into 64 slots: a lapped reader keeps an eighth (8) clear, so 56 read, 44 lost
            ring.write_sample(step, 1000 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        os.close(os.open(runtime_dir / "open-r0.ring", os.O_CREAT | os.O_WRONLY, 0o600))
        os.chmod(runtime_dir / "open-r0.ring", 0o644)
        sidecar.collector.scan()
        assert sidecar.collector.poll() == 56
        lines = render(exporters.state).splitlines()
        labels = f'run_id="lap",rank="1",engine="raw",model="unknown",host="unknown",pid="{os.getpid()}"'
        assert f"memwatch_samples_total{{{labels}}} 56" in lines
        assert f"memwatch_ring_records_lost_total{{{labels}}} 44" in lines
        assert [line for line in lines if line.startswith("memwatch_rings_refused{")] == [
            'memwatch_rings_refused{reason="untrusted_uid"} 0', 'memwatch_rings_refused{reason="mode"} 1',
            'memwatch_rings_refused{reason="not_regular"} 0', 'memwatch_rings_refused{reason="unreadable"} 0',
            'memwatch_rings_refused{reason="invalid"} 0']
    finally:
        sidecar.close()
        ring.close()
    assert sidecar.exporters is None  # closed with the sidecar
