"""The discovery thread: names the kernel reports are judged as they appear; refusals go with their names; a
queue the kernel overflowed is made good by listing again; without inotify the directory is scanned.

Real files in a private runtime directory, a real inotify watch, the thread itself.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from stuck_log import StuckLog

from memwatch.sidecar.daemon import Sidecar
from memwatch.sidecar.dir_watch import (
    IN_ATTRIB,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_MOVE_SELF,
    IN_Q_OVERFLOW,
    DirWatch,
    watch_dir,
)
from memwatch.sidecar.discovery import MAX_PENDING, STOP_WAIT_S, Discovery
from memwatch.sidecar.ring_finder import RingFinder
from memwatch.store import open_store
from memwatch_engine import Monitor
from memwatch_engine.ring_reader import RingReader

from probes import ScriptedProbe
from stored_runs import drain


def _make(directory: Path, name: str, mode: int = 0o600) -> None:
    fd = os.open(directory / name, os.O_CREAT | os.O_WRONLY | os.O_EXCL, mode)
    os.fchmod(fd, mode)
    os.close(fd)


def _until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def finder(runtime_dir: Path) -> Iterator[RingFinder]:
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    found = RingFinder(runtime_dir)
    yield found
    found.close()


@pytest.mark.parametrize("watch", [True, False])
def test_a_new_ring_is_handed_over_and_a_refused_name_is_forgotten_when_it_goes(
        finder: RingFinder, runtime_dir: Path, watch: bool) -> None:
    _make(runtime_dir, "before-r0.ring")
    _make(runtime_dir, "notes.txt")
    discovery = Discovery(finder, interval=0.05, watch=watch)
    assert discovery.watching is watch
    discovery.start()
    try:
        taken: list[str] = []
        _until(lambda: taken.extend(discovery.take()) or "before-r0.ring" in taken)  # the first listing
        _make(runtime_dir, "after-r0.ring")
        _make(runtime_dir, "open-r0.ring", 0o644)  # every user may read it: refused
        _until(lambda: taken.extend(discovery.take()) or "after-r0.ring" in taken)
        _until(lambda: finder.refused.counts()["mode"] == 1)
        assert "open-r0.ring" not in taken and "notes.txt" not in taken
        (runtime_dir / "open-r0.ring").unlink()
        _until(lambda: finder.refused.counts()["mode"] == 0)  # refused now, not ever
        os.chmod(runtime_dir / "before-r0.ring", 0o644)
        _until(lambda: finder.refused.counts()["mode"] == 1)  # its mode changed: judged again, and refused
    finally:
        discovery.stop()
    if watch:
        assert discovery.listings == 1  # listed once; everything after came from the kernel


def test_the_kernel_reports_names_made_and_removed_and_says_when_it_dropped_some(runtime_dir: Path) -> None:
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(runtime_dir, os.O_RDONLY | os.O_DIRECTORY)
    watch = watch_dir(fd)
    assert isinstance(watch, DirWatch) and not os.get_blocking(watch.fileno())  # else changes() would wait
    try:
        os.close(os.open(runtime_dir / "a-r0.ring", os.O_CREAT | os.O_WRONLY, 0o600))
        os.chmod(runtime_dir / "a-r0.ring", 0o644)  # a change of mode: judged again
        (runtime_dir / "a-r0.ring").unlink()
        changes = watch.changes()
        assert [(c.name, c.appeared) for c in changes] == [("a-r0.ring", True)] * 2 + [("a-r0.ring", False)]
        assert watch.changes() == [] and not watch.overflowed  # nothing more queued: no wait
        event = IN_Q_OVERFLOW.to_bytes(4, "little")
        overflow = (-1).to_bytes(4, "little", signed=True) + event + bytes(8)  # the kernel's overflow record
        assert watch._parse(overflow) == [] and watch.overflowed
        named = (1).to_bytes(4, "little") + (IN_CREATE | IN_DELETE).to_bytes(4, "little") + bytes(4) + \
            (16).to_bytes(4, "little") + b"x.ring".ljust(16, b"\0")
        assert [(c.name, c.appeared) for c in watch._parse(named)] == [("x.ring", True)]
    finally:
        watch.close()
        os.close(fd)


def test_a_stopped_discovery_ends_within_its_wait_and_closes_its_watch(finder: RingFinder) -> None:
    discovery = Discovery(finder, interval=0.05)
    discovery.start()
    began = time.monotonic()
    discovery.stop()
    assert time.monotonic() - began < 1.0 and not discovery._thread.is_alive()


def test_each_record_the_kernel_writes_is_read_for_what_it_says(runtime_dir: Path) -> None:
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(runtime_dir, os.O_RDONLY | os.O_DIRECTORY)
    watch = watch_dir(fd)
    assert watch is not None and watch.overflowed is False
    assert os.get_blocking(watch.fileno()) is False and os.get_inheritable(watch.fileno()) is False

    def record(mask: int, name: bytes = b"") -> bytes:
        padded = name.ljust(16, b"\0") if name else b""
        return (1).to_bytes(4, "little") + mask.to_bytes(4, "little") + bytes(4) + len(padded).to_bytes(4, "little") \
            + padded

    try:
        for ended in (IN_IGNORED, IN_DELETE_SELF, IN_MOVE_SELF):  # the watch itself ended: list again
            watch.overflowed = False
            assert watch._parse(record(ended)) == [] and watch.overflowed, ended
        watch.overflowed = False
        assert watch._parse(record(IN_ATTRIB)) == []  # the directory's own change: no name
        assert watch._parse(record(0x20, b"x.ring")) == []  # opened: nothing the finder acts on
        both = record(IN_CREATE, b"a.ring") + record(IN_DELETE, b"b.ring")
        assert [(c.name, c.appeared) for c in watch._parse(both)] == [("a.ring", True), ("b.ring", False)]
        assert not watch.overflowed
    finally:
        watch.close()
        watch.close()  # a second close closes nothing more
        os.close(fd)
    assert watch.fileno() == -1


def test_a_watch_that_cannot_be_read_or_made_says_so_and_the_directory_is_listed(
        runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(runtime_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        watch = watch_dir(fd)
        assert watch is not None
        os.close(watch.fileno())  # gone under it
        assert watch.changes() == [] and watch.overflowed is True
        assert [r.getMessage() for r in caplog.records] == [
            "cannot read the runtime directory's changes: Bad file descriptor; listing it instead"]
    finally:
        os.close(fd)
    regular = tmp_path / "not-a-directory"
    regular.write_text("")
    file_fd = os.open(regular, os.O_RDONLY)
    try:
        assert watch_dir(file_fd) is None
    finally:
        os.close(file_fd)
    assert caplog.records[-1].getMessage() == (
        "cannot watch the runtime directory (Not a directory): it is listed at every scan instead")
    # No descriptor left for the watch: the same, and why.
    out = subprocess.run([sys.executable, "-c", NO_DESCRIPTORS, str(runtime_dir)], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "None", out.stderr
    assert ("cannot watch the runtime directory (Too many open files): it is listed at every scan instead, which a "
            "flood of names slows down") in out.stderr


NO_DESCRIPTORS = """
import logging, os, resource, sys
logging.basicConfig(level=logging.DEBUG, format="%(message)s")
from memwatch.sidecar.dir_watch import watch_dir
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
watch_dir(fd).close()  # whatever the first call loads is loaded while descriptors are left
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print(watch_dir(fd))
"""


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_discovery_is_a_named_daemon_thread_watching_by_default_and_leaves_no_descriptor(
        finder: RingFinder) -> None:
    before = _descriptors()
    discovery = Discovery(finder, interval=0.05)
    assert discovery.watching and not discovery.running and not discovery.pending
    discovery.start()
    try:
        _until(lambda: discovery.listings == 1)
        threads = [t for t in threading.enumerate() if t.name == "memwatch-discovery"]
        assert len(threads) == 1 and threads[0].daemon  # a stuck one never holds the sidecar's exit
        assert discovery.running
    finally:
        discovery.stop()
    assert not discovery.running and _descriptors() == before  # the watch closed with the thread


def test_found_names_wait_for_the_loop_4096_at_most_and_the_rest_are_found_by_a_listing_once_taken(
        finder: RingFinder, runtime_dir: Path) -> None:
    names = {f"{i:05d}-r0.ring" for i in range(MAX_PENDING + 4)}
    for name in names:
        _make(runtime_dir, name)
    handed = []
    discovery = Discovery(finder, interval=0.05, on_found=lambda: handed.append(1))
    discovery.start()
    try:
        _until(lambda: len(handed) == MAX_PENDING)
        time.sleep(0.3)  # several waits: nothing more is handed while the loop has not taken these
        assert len(handed) == MAX_PENDING and discovery.pending
        first = discovery.take()
        assert len(first) == MAX_PENDING and len(set(first)) == MAX_PENDING and not discovery.pending
        taken = set(first)
        _until(lambda: taken.update(discovery.take()) or taken == names, timeout=20)  # the loop taking as it runs
    finally:
        discovery.stop()
    assert discovery.listings >= 2  # listed again for the names past the bound


def test_the_directory_moved_is_listed_again_and_still_watched(finder: RingFinder, runtime_dir: Path) -> None:
    discovery = Discovery(finder, interval=0.05)
    discovery.start()
    moved = runtime_dir.with_name("moved")
    try:
        _until(lambda: discovery.listings == 1)
        runtime_dir.rename(moved)
        _until(lambda: discovery.listings == 2)
        _make(moved, "late-r0.ring")
        taken: list[str] = []
        _until(lambda: taken.extend(discovery.take()) or "late-r0.ring" in taken)
        time.sleep(0.2)
        assert discovery.listings == 2  # once for the move, not at every wait
    finally:
        discovery.stop()
        moved.rename(runtime_dir)


def test_a_failure_in_the_thread_is_said_once_and_ends_it(finder: RingFinder, runtime_dir: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("the loop's wake-up failed")

    _make(runtime_dir, "a-r0.ring")
    discovery = Discovery(finder, interval=0.05, on_found=broken)
    discovery.start()
    try:
        _until(lambda: not discovery.running)
    finally:
        discovery.stop()
    failed = [r for r in caplog.records if r.name == "memwatch.collector" and r.levelno == logging.ERROR]
    assert [r.getMessage() for r in failed] == [
        "finding rings failed; new rings are no longer opened until the sidecar restarts"]
    assert failed[0].exc_info is not None and "the loop's wake-up failed" in str(failed[0].exc_info[1])
    assert discovery.take() == ["a-r0.ring"]  # handed before the failure


def test_a_ring_made_during_a_long_listing_is_handed_before_the_listing_ends(finder: RingFinder,
                                                                              runtime_dir: Path) -> None:
    for i in range(3000):
        _make(runtime_dir, f"{i:05d}-r0.ring")
    handed: list[int] = []

    def found() -> None:  # in the discovery thread, at its listing's first name
        if not handed:
            _make(runtime_dir, "new-r0.ring")
        handed.append(1)

    discovery = Discovery(finder, interval=0.05, on_found=found)
    discovery.start()
    try:
        _until(lambda: discovery.listings == 1 and len(handed) >= 3001)
        time.sleep(0.3)
        names = discovery.take()
    finally:
        discovery.stop()
    assert len(set(names)) == len(names) == 3001  # found twice (by the kernel, then the listing): handed once
    assert names.index("new-r0.ring") <= 1024 + 1  # judged at the listing's next slice, not after 3,000 names


def test_a_stuck_thread_is_waited_for_5_s_in_all_and_closes_its_watch_once_released(finder: RingFinder,
                                                                                    runtime_dir: Path) -> None:
    before = _descriptors()
    gate, entered = threading.Event(), threading.Event()

    def found() -> None:  # the thread's hand-over never returns until the gate opens
        entered.set()
        gate.wait(60)

    _make(runtime_dir, "a-r0.ring")
    discovery = Discovery(finder, interval=0.05, on_found=found)
    discovery.start()
    try:
        assert entered.wait(5)
        began = time.monotonic()
        discovery.stop(timeout=1.0)  # the last drain's stop
        first = time.monotonic() - began
        discovery.stop()  # the close's: only what is left of the 5 s
        total = time.monotonic() - began
        assert 0.9 <= first <= 1.5 and STOP_WAIT_S - 0.1 <= total <= STOP_WAIT_S + 0.5, (first, total)
        # The watch stays open while the thread may read it, and the listing under way holds the folder's own
        # descriptor (the listing's reopened one, so that another listing moves no offset of it).
        assert discovery.running and _descriptors() == before + 3
        began = time.monotonic()
        discovery.stop()
        assert time.monotonic() - began < 0.5  # spent: a further stop waits no more
    finally:
        gate.set()
    _until(lambda: not discovery.running)
    assert _descriptors() == before and discovery.take() == ["a-r0.ring"]  # the released thread closed it itself




def test_a_sidecar_stopped_with_its_discovery_stuck_waits_5_s_for_it_and_leaves_its_rows_whole(
        runtime_dir: Path, db_path: Path, stuck_log: StuckLog) -> None:
    sidecar = Sidecar(runtime_dir, db_path, poll_interval=0.05, scan_interval=0.05)
    sidecar.start()
    monitor = Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False,
                      run_id="stuck")
    loop = threading.Thread(target=sidecar.run, name="sidecar-under-test")
    loop.start()
    try:
        _until(lambda: sidecar.collector.rings)  # the engine's ring is open before the thread sticks
        _make(runtime_dir, "other-r0.ring", 0o644)  # refused, and said so: the thread's log write never returns
        assert stuck_log.entered.wait(5)
        for _ in range(5):
            monitor.step("decode", num_seqs=1)
        began = time.monotonic()
        sidecar.stop()
        loop.join(STOP_WAIT_S + 5)
        took = time.monotonic() - began
        assert not loop.is_alive(), "the sidecar's stop waited for the stuck thread without a bound"
        stuck = [t for t in threading.enumerate() if t.name == "memwatch-discovery"]
        assert len(stuck) == 1  # still in its log write: the sidecar exited without it
        # The last drain's stop waits 1 s of the 5, the close the 4 left: 5 s in all, not 1 + 5.
        assert STOP_WAIT_S - 0.1 <= took <= STOP_WAIT_S + 0.9, took
        stuck_log.gate.set()
        stuck[0].join(5)
        assert not stuck[0].is_alive()  # released, it ends (and closes its watch) instead of listing on
        # Everything the ring held is stored once, its cursor with it: the rows of the monitor's start and the 5 steps.
        db = open_store(db_path, readonly=True)
        try:
            assert db.execute("PRAGMA quick_check").fetchone() == ("ok",)
            steps = db.execute("SELECT count(*) FROM samples WHERE run_id = 'stuck' AND step_kind = 'decode'")
            assert steps.fetchone() == (5,)
            cursor = db.execute("SELECT next_seq, finished FROM ring_cursors WHERE ring LIKE 'stuck/0/%'").fetchone()
            assert monitor.ring_path is not None
            ring = RingReader(monitor.ring_path)
            assert cursor == (ring.published, 0)  # every record read; the ring stays for its writer
            ring.close()
        finally:
            db.conn.close()
        # The lock went with it: the next sidecar takes the directory and resumes at the cursor.
        for _ in range(3):
            monitor.step("decode", num_seqs=1)
        monitor.close()
        follower = Sidecar(runtime_dir, db_path)
        follower.start()
        try:
            follower.collector.scan()
            drain(follower.collector)
        finally:
            follower.close()
        db = open_store(db_path, readonly=True)
        try:
            steps = db.execute("SELECT count(*) FROM samples WHERE run_id = 'stuck' AND step_kind = 'decode'")
            assert steps.fetchone() == (5 + 3,)
            assert db.execute("SELECT status FROM runs WHERE run_id = 'stuck'").fetchone() == ("ok",)
        finally:
            db.conn.close()
    finally:
        stuck_log.gate.set()
        sidecar.stop()
        loop.join(30)
        monitor.close()
