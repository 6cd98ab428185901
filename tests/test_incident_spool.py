"""The spool's own rules, in process on real files: what it takes, from where, in what order, and what it keeps.

A bundle built on another file system (a build folder on tmpfs, the spool on disk) is copied whole, by
descriptor, then its source removed; a bundle already spooled is not taken twice; a link or a folder named like a
bundle is never taken nor listed; the oldest is first by time, then by name; the newest stays even over the cap;
a drop that cannot be told is still dropped; a shipped bundle is deleted only while its name is that file.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
from test_incident_ship import make_bundle

from memwatch.errors import UsageError
from memwatch.incident import spool
from memwatch.incident.spool import Spool, identity
from memwatch_engine.dirfd import NotRegularFile, open_dir, private_dir


@pytest.fixture
def box(tmp_path: Path):  # type: ignore[no-untyped-def]
    state = private_dir(tmp_path / "state")
    woken: list[int] = []
    made = Spool(state, tmp_path / "state", on_enqueue=lambda: woken.append(1))
    made.woken = woken  # type: ignore[attr-defined]
    yield made
    made.close()
    os.close(state)


def _dated(path: Path, seconds: int) -> Path:
    os.utime(path, ns=(seconds * 1_000_000_000,) * 2)
    return path


def test_a_bundle_from_another_file_system_is_copied_whole_and_its_source_removed(box: Spool) -> None:
    if os.stat("/dev/shm").st_dev == os.fstat(box.fd).st_dev:
        pytest.skip("/dev/shm is on the spool's file system here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        bundle = make_bundle(Path(shm), run="far", size=3 * spool.COPY_CHUNK)  # more than one chunk
        data = bundle.read_bytes()
        box.enqueue(bundle)
        assert not bundle.exists() and box.woken == [1]  # type: ignore[attr-defined]
    assert os.listdir(box.fd) == [bundle.name]  # no .tmp left over
    fd, info = box.open(bundle.name)
    with os.fdopen(fd, "rb") as copied:
        assert copied.read() == data
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_dev == os.fstat(box.fd).st_dev


def test_a_bundle_spooled_before_is_not_taken_twice_and_its_source_goes(box: Spool, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "out", run="twice")
    box.enqueue(bundle)
    fd, first = box.open(bundle.name)
    os.close(fd)
    again = make_bundle(tmp_path / "again", run="twice")
    os.rename(again, tmp_path / "out" / bundle.name)  # the build folder still holds it: handed on, not removed
    box.enqueue(tmp_path / "out" / bundle.name)
    fd, now = box.open(bundle.name)
    os.close(fd)
    assert identity(now) == identity(first) and not bundle.exists()
    assert box.woken == [1]  # type: ignore[attr-defined]  # nothing new to ship


def test_links_folders_and_other_names_are_never_taken_nor_listed(box: Spool, tmp_path: Path) -> None:
    target = make_bundle(tmp_path / "elsewhere", run="target")
    out = tmp_path / "out"
    out.mkdir()
    link = out / target.name
    link.symlink_to(target)
    with pytest.raises(NotRegularFile):
        box.enqueue(link)
    assert target.exists() and link.is_symlink() and box.pending() == []
    with pytest.raises(UsageError, match="not an incident bundle's name"):
        box.enqueue_from(open_dir(out), "memwatch-incident-x.tar.gz.part")
    folder = Path(box.path) / "memwatch-incident-20261204T000000Z-pod-folder.tar.gz"
    folder.mkdir()
    (Path(box.path) / "memwatch-incident-20261204T000000Z-pod-link.tar.gz").symlink_to(target)
    (Path(box.path) / "notes.tar.gz").write_bytes(b"x")
    assert box.sizes() == [] and box.pending() == [] and box.oldest() is None
    assert not box.holds(folder.name) and not box.holds("memwatch-incident-20261204T000000Z-pod-link.tar.gz")


def test_the_oldest_is_first_by_time_then_by_name(box: Spool, tmp_path: Path) -> None:
    b = _dated(make_bundle(tmp_path / "b", run="b"), 20)
    a = _dated(make_bundle(tmp_path / "a", run="a"), 30)
    c = _dated(make_bundle(tmp_path / "c", run="c"), 20)
    for path in (a, b, c):
        box.enqueue(path)
    by_time = sorted([(20, b.name), (20, c.name), (30, a.name)])
    assert box.pending() == [name for _, name in by_time]
    assert box.sizes() == [(name, os.stat(name, dir_fd=box.fd).st_size) for _, name in by_time]
    assert box.oldest() == (by_time[0][1], 20_000_000_000)
    assert box.holds(a.name) and not box.holds("memwatch-incident-none.tar.gz")


def test_the_newest_stays_over_the_cap_and_a_drop_not_told_is_still_dropped(tmp_path: Path) -> None:
    state = private_dir(tmp_path / "state")
    box = Spool(state, tmp_path / "state", cap_bytes=100, cap_count=64)  # smaller than any one bundle

    def tell(name: str, size: int, why: str) -> None:
        raise RuntimeError("the database is locked")

    box.on_drop = tell
    old, new = _dated(make_bundle(tmp_path / "o", run="old"), 10), _dated(make_bundle(tmp_path / "n", run="new"), 20)
    box.enqueue(old)
    assert box.pending() == [old.name] and box.dropped == 0  # the newest always stays, even alone over the cap
    box.enqueue(new)
    assert box.pending() == [new.name] and box.dropped == 1
    assert box.enforce_cap(keep=new.name) == [] and box.pending() == [new.name]
    box.close()
    box.close()  # twice is harmless
    assert box.fd == -1
    os.close(state)


def test_a_shipped_bundle_is_removed_only_while_its_name_is_that_file(box: Spool, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "out", run="r")
    box.enqueue(bundle)
    fd, shipped = box.open(bundle.name)
    os.close(fd)
    os.rename(Path(box.path) / bundle.name, tmp_path / "aside")  # kept: its inode is not reused for the next file
    other = make_bundle(tmp_path / "other", run="r")
    os.rename(other, Path(box.path) / bundle.name)  # another file under the name since the upload
    box.remove(bundle.name, identity(shipped))
    assert box.pending() == [bundle.name]
    fd, now = box.open(bundle.name)
    os.close(fd)
    box.remove(bundle.name, identity(now))
    assert box.pending() == []


def test_the_active_spool_takes_what_a_build_hands_it_until_it_stops(box: Spool, tmp_path: Path) -> None:
    first = make_bundle(tmp_path / "out", run="one")
    spool.activate(box)
    try:
        spool.enqueue(first)
    finally:
        spool.activate(None)
    assert box.pending() == [first.name] and not first.exists()
    second = make_bundle(tmp_path / "out", run="two")
    spool.enqueue(second)  # no sidecar shipping: it stays where it was built
    assert second.exists() and box.pending() == [first.name]
