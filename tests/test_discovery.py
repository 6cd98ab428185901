"""The discovery thread: names the kernel reports are judged as they appear; refusals go with their names; a
queue the kernel overflowed is made good by listing again; without inotify the directory is scanned.

Real files in a private runtime directory, a real inotify watch, the thread itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memwatch.sidecar.dir_watch import IN_CREATE, IN_DELETE, IN_Q_OVERFLOW, DirWatch, watch_dir
from memwatch.sidecar.discovery import Discovery
from memwatch.sidecar.ring_finder import RingFinder


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
    assert isinstance(watch, DirWatch)
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
