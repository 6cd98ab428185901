"""The spool's own rules, in process on real files: what it takes, from where, in what order, and what it keeps.

A bundle built on another file system (a build folder on tmpfs, the spool on disk) is copied whole, by
descriptor, then its source removed; a bundle already spooled is not taken twice; a link or a folder named like a
bundle is never taken nor listed; the oldest is first by time, then by name; the newest stays even over the cap;
a drop that cannot be told is still dropped; a shipped bundle is deleted only while its name is that file.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

import pytest
from test_incident_ship import make_bundle

from memwatch.errors import PermissionDeniedError, UsageError
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


def test_a_closed_spool_holds_nothing_and_never_lists_the_working_directory(box: Spool, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    box.enqueue(make_bundle(tmp_path / "a", run="a"))
    monkeypatch.chdir(tmp_path / "a")  # what a listing of descriptor -1 would read: the working directory
    stray = make_bundle(tmp_path / "a", run="stray")
    box.close()
    assert (box.sizes(), box.oldest()) == ([], None)
    assert stray.exists()


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


def test_at_the_count_cap_nothing_goes_and_past_it_the_oldest_go_each_told_with_its_size_and_why(
        tmp_path: Path) -> None:
    state = private_dir(tmp_path / "state")
    box = Spool(state, tmp_path / "state", cap_bytes=10**9, cap_count=2)
    told: list[tuple[str, int, str]] = []
    box.on_drop = lambda name, size, why: told.append((name, size, why))
    a, b, c, d = (_dated(make_bundle(tmp_path / k, run=k), t) for k, t in (("a", 10), ("b", 20), ("c", 30), ("d", 40)))
    box.enqueue(a)
    box.enqueue(b)
    assert box.pending() == [a.name, b.name] and told == []  # exactly at the cap: nothing dropped
    sizes = dict(box.sizes())
    box.enqueue(c)
    box.enqueue(d)
    assert box.pending() == [c.name, d.name] and box.dropped == 2
    assert told == [(a.name, sizes[a.name], "the spool holds 3 bundles, over its cap of 2"),
                    (b.name, sizes[b.name], "the spool holds 3 bundles, over its cap of 2")]
    box.close()
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


class SwappedOnTheWay(Spool):
    """A spool whose source name is swapped (by real renames and links) between its look and its move: the moment
    :meth:`holds` is asked is the window another process of the build folder's owner would have."""

    swap: str = "file"

    def holds(self, name: str) -> bool:
        source = self.source  # type: ignore[attr-defined]
        os.rename(source / name, source.parent / "original")
        if self.swap == "file":
            make_bundle(source.parent / "impostor", run="impostor").rename(source / name)
        else:  # a link to the very file that was judged: following it would take it for the same
            (source / name).symlink_to(source.parent / "original")
        return super().holds(name)


@pytest.mark.parametrize("swap", ["file", "link"])
def test_a_bundle_swapped_while_it_is_spooled_is_handed_back_not_shipped(tmp_path: Path, swap: str) -> None:
    state = private_dir(tmp_path / "state")
    box = SwappedOnTheWay(state, tmp_path / "state")
    box.swap = swap
    bundle = make_bundle(tmp_path / "out", run="swapped")
    box.source = bundle.parent  # type: ignore[attr-defined]
    told: list[int] = []
    box.on_enqueue = lambda: told.append(1)
    with pytest.raises(UsageError, match=f"^{bundle.name} changed while it was spooled; not shipped$"):
        box.enqueue(bundle)
    assert box.pending() == [] and os.listdir(box.fd) == [] and told == []
    assert os.path.lexists(bundle) and bundle.is_symlink() == (swap == "link")  # handed back where it was
    box.close()
    os.close(state)


def test_partial_copies_are_removed_at_start_and_nothing_else(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = private_dir(tmp_path / "state")
    folder = tmp_path / "state" / "bundles"
    folder.mkdir(mode=0o700)
    for name in (".memwatch-incident-a.tar.gz.tmp", ".other.tmp", ".hidden", "notes.tmp", "x.TMP"):
        (folder / name).write_bytes(b"x")
    caplog.set_level(logging.INFO, "memwatch.incident")
    Spool(state, tmp_path / "state").close()
    assert sorted(os.listdir(folder)) == [".hidden", "notes.tmp", "x.TMP"]
    assert sorted(r.getMessage() for r in caplog.records) == [
        "bundle spool: removed .memwatch-incident-a.tar.gz.tmp, a copy cut short",
        "bundle spool: removed .other.tmp, a copy cut short"]
    os.close(state)


def test_a_spool_others_may_enter_is_refused_in_one_line(tmp_path: Path) -> None:
    state = private_dir(tmp_path / "state")
    (tmp_path / "state" / "bundles").mkdir(mode=0o755)
    os.chmod(tmp_path / "state" / "bundles", 0o755)
    with pytest.raises(PermissionDeniedError) as refused:
        Spool(state, tmp_path / "state")
    assert str(refused.value) == (f"cannot use {tmp_path / 'state' / 'bundles'} as the bundle spool: mode 755 lets "
                                  "other users in; chmod 700 it; it must be a directory of the sidecar's user, "
                                  "mode 0700")
    os.close(state)


def test_a_stale_copy_is_replaced_and_strays_never_hide_a_bundle(box: Spool, tmp_path: Path) -> None:
    if os.stat("/dev/shm").st_dev == os.fstat(box.fd).st_dev:
        pytest.skip("/dev/shm is on the spool's file system here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        bundle = make_bundle(Path(shm), run="again")
        (Path(box.path) / f".{bundle.name}.tmp").write_bytes(b"a copy cut short, the spool still open")
        box.enqueue(bundle)
    for i in range(12):  # whatever order the folder lists them in, a stray never ends the listing
        (Path(box.path) / f"stray-{i}.txt").write_bytes(b"x")
    others = [make_bundle(tmp_path / f"o{i}", run=f"o{i}") for i in range(3)]
    for path in others:
        box.enqueue(path)
    assert sorted(box.pending()) == sorted([bundle.name, *(p.name for p in others)])
    assert box.oldest() is not None and box.oldest()[0] in box.pending()


def _three(box: Spool, tmp_path: Path) -> list[str]:
    paths = [_dated(make_bundle(tmp_path / f"t{i}", run=f"t{i}"), 10 * (i + 1)) for i in range(3)]
    for path in paths:
        box.enqueue(path)
    return [p.name for p in paths]


def test_the_cap_drops_exactly_what_is_over_it_and_says_which_cap(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    state = private_dir(tmp_path / "state")
    box = Spool(state, tmp_path / "state")  # the default caps: nothing dropped yet
    names = _three(box, tmp_path)
    sizes = dict(box.sizes())
    assert box.enforce_cap() == [] and box.dropped == 0
    box.cap_count = 1
    assert box.enforce_cap(keep=names[0]) == names[1:]  # the one kept need not be the newest
    assert box.pending() == [names[0]]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"bundle_dropped {name} ({sizes[name]} bytes): the spool holds {count} bundles, over its cap of 1; the oldest "
        "go first" for name, count in zip(names[1:], (3, 2), strict=True)]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # nobody to tell: nothing failed
    box.close()
    os.close(state)


def test_over_its_bytes_only_the_oldest_goes_and_a_failed_telling_is_logged(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    state = private_dir(tmp_path / "state")
    box = Spool(state, tmp_path / "state")
    names = _three(box, tmp_path)
    sizes = dict(box.sizes())
    box.cap_count, box.cap_bytes = 3, sizes[names[1]] + sizes[names[2]]  # room for two of the three: one goes

    def tell(name: str, size: int, why: str) -> None:
        raise RuntimeError("the database is locked")

    box.on_drop = tell
    assert box.enforce_cap() == [names[0]] and box.pending() == names[1:]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        f"bundle_dropped {names[0]} ({sizes[names[0]]} bytes): the spool holds {sum(sizes.values()):,} bytes, over "
        f"its cap of {box.cap_bytes:,}; the oldest go first",
        f"bundle {names[0]} dropped, not recorded: the database is locked"]
    box.close()
    os.close(state)


def test_without_a_sidecar_shipping_the_bundle_stays_and_the_log_says_where(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    bundle = make_bundle(tmp_path / "out", run="kept")
    caplog.set_level(logging.INFO, "memwatch.incident")
    spool.enqueue(bundle)
    assert bundle.exists()
    assert [r.getMessage() for r in caplog.records] == [f"bundle {bundle.name} kept at {bundle} (no --bundle-to)"]
