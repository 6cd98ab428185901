"""The ring finder on its own: names judged by ``lstat`` (a link, a path, an unreadable name refused for what it
is), refusals forgotten when a name is fine again or gone, a quiet directory not listed again until it changes or
its full scan is due, a slow scan followed by a pause four times as long, and a closed finder that looks at nothing.

Real files, a real directory and its descriptor; we run as root, so a ring of another uid is made by ``chown``.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memwatch.sidecar import ring_finder
from memwatch.sidecar.log_limit import LogLimiter
from memwatch.sidecar.refused_names import REASONS
from memwatch.sidecar.ring_finder import LISTING_SLICE, RingFinder

UNTRUSTED = 4321
"""A uid nobody trusts here (the tests run as root)."""


def _make(directory: Path, name: str, mode: int = 0o600, uid: int | None = None) -> Path:
    path = directory / name
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, mode)
    os.fchmod(fd, mode)
    if uid is not None:
        os.fchown(fd, uid, -1)
    os.close(fd)
    return path


def _age(directory: Path, seconds: float) -> None:
    """Set the directory's modification time ``seconds`` back: a directory nobody changed for that long."""
    then = time.time_ns() - int(seconds * 1e9)
    os.utime(directory, ns=(then, then))


def _counts(**nonzero: int) -> dict[str, int]:
    return {reason: nonzero.get(reason, 0) for reason in REASONS}


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "memwatch.collector"]


@pytest.fixture
def finder(runtime_dir: Path) -> Iterator[RingFinder]:
    found = RingFinder(runtime_dir)
    yield found
    found.close()


def test_a_name_is_judged_by_lstat_and_refused_for_what_it_is(finder: RingFinder, runtime_dir: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    ring = _make(runtime_dir, "a-r0.ring")
    _make(runtime_dir, "notes.txt")  # trusted by owner and mode, but not a ring by name
    (runtime_dir / "sub").mkdir(mode=0o700)
    _make(runtime_dir / "sub", "b-r0.ring")
    os.symlink("a-r0.ring", runtime_dir / "link-r0.ring")
    long = "x" * 300 + ".ring"
    assert finder.judge("a-r0.ring") is True
    assert finder.judge("notes.txt") is False
    assert finder.judge("sub/b-r0.ring") is False  # a name of the directory's, never a path below it
    assert finder.judge("gone-r0.ring") is False  # went before it was looked at: nothing to refuse
    assert finder.judge("link-r0.ring") is False  # the link itself is judged, never the ring it names
    assert finder.judge(long) is False  # the kernel refuses the name itself
    assert finder.refused.counts() == _counts(not_regular=1, unreadable=1)
    assert "link-r0.ring" in finder.refused and long in finder.refused and "gone-r0.ring" not in finder.refused
    ring.chmod(0o644)
    assert finder.judge("a-r0.ring") is False
    assert finder.refused.counts() == _counts(not_regular=1, unreadable=1, mode=1)
    ring.chmod(0o600)  # fine again: judged afresh, its refusal gone
    assert finder.judge("a-r0.ring") is True
    assert finder.refused.counts() == _counts(not_regular=1, unreadable=1)
    assert _said(caplog) == [
        f"ignoring ring {runtime_dir}/link-r0.ring: not a regular file",
        f"ignoring ring {runtime_dir}/{long}: File name too long",
        f"ignoring ring {runtime_dir}/a-r0.ring: mode 644 lets every user read it"]


def test_rings_of_an_untrusted_uid_are_refused_and_named_once_per_uid_unless_trusted(
        runtime_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("u1-r0.ring", "u2-r0.ring"):
        _make(runtime_dir, name, uid=UNTRUSTED)
    _make(runtime_dir, "w-r0.ring", 0o620)  # ours, but the group may write it
    finder = RingFinder(runtime_dir)
    try:
        assert sorted(finder.listing()) == []
        assert finder.refused.counts() == _counts(untrusted_uid=2, mode=1)
        said = sorted(_said(caplog), key=lambda line: "w-r0.ring" in line)
        assert len(said) == 2
        assert said[1] == f"ignoring ring {runtime_dir}/w-r0.ring: mode 620 lets other users write it"
        assert f"owned by uid {UNTRUSTED}, which this sidecar does not trust" in said[0]  # one of its two rings
        assert finder.open("u1-r0.ring") is None and len(_said(caplog)) == 2  # the same uid: counted, not named again
    finally:
        finder.close()
    trusting = RingFinder(runtime_dir, trust=[UNTRUSTED])
    try:
        assert sorted(trusting.listing()) == ["u1-r0.ring", "u2-r0.ring"]
        opened = trusting.open("u2-r0.ring")
        assert opened is not None and opened[1].st_uid == UNTRUSTED
        os.close(opened[0])
    finally:
        trusting.close()


def test_a_quiet_directory_is_listed_again_only_once_it_changed_or_its_full_scan_is_due(
        finder: RingFinder, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ring_finder, "FULL_SCAN_S", 1.0)
    _make(runtime_dir, "a-r0.ring")
    _age(runtime_dir, 10)
    began = time.monotonic()
    assert list(finder.candidates()) == ["a-r0.ring"]
    assert list(finder.candidates()) == []  # unchanged: not listed again
    _make(runtime_dir, "b-r0.ring")  # changed now
    assert sorted(finder.candidates()) == ["a-r0.ring", "b-r0.ring"]
    # Changed under 2 s ago: the next change may fall in the same tick of its clock, so it is listed every time.
    assert sorted(finder.candidates()) == ["a-r0.ring", "b-r0.ring"]
    _age(runtime_dir, 10)
    assert sorted(finder.candidates()) == ["a-r0.ring", "b-r0.ring"]
    assert list(finder.candidates()) == []
    assert time.monotonic() - began < 1.0, "too slow to see the full scan's bound"
    time.sleep(1.05)
    assert sorted(finder.candidates()) == ["a-r0.ring", "b-r0.ring"]  # unchanged, but the full scan is due


def test_a_slow_scan_is_followed_by_the_next_no_sooner_than_four_times_its_length_later(
        finder: RingFinder, runtime_dir: Path) -> None:
    for i in range(LISTING_SLICE):
        _make(runtime_dir, f"{i:05d}-r0.ring")
    began = time.monotonic()
    assert len(list(finder.candidates(between=lambda: time.sleep(0.6)))) == LISTING_SLICE  # a scan of 0.6 s or more
    took = time.monotonic() - began
    _make(runtime_dir, "late-r0.ring")  # a change: listed at once, but for the pause
    while not (found := list(finder.candidates())):
        time.sleep(0.01)
    waited = time.monotonic() - began
    assert "late-r0.ring" in found
    assert (1 + 4) * took - 0.05 <= waited <= (1 + 4) * took + 0.4, (took, waited)  # not 4 + 2 times


def test_a_fast_scan_is_not_paused_and_each_scan_says_what_the_log_dropped_in_windows_that_ended(
        finder: RingFinder, runtime_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    finder.limited = LogLimiter(logging.getLogger("memwatch.collector"), lines=1, window=0.2)
    _make(runtime_dir, "a-r0.ring")
    _make(runtime_dir, "o1-r0.ring", 0o644)
    _make(runtime_dir, "o2-r0.ring", 0o644)
    assert list(finder.candidates()) == ["a-r0.ring"] and len(_said(caplog)) == 1  # one said, one dropped
    time.sleep(0.25)
    _make(runtime_dir, "b-r0.ring")
    assert sorted(finder.candidates()) == ["a-r0.ring", "b-r0.ring"]  # at once
    assert len(_said(caplog)) == 2 and _said(caplog)[1].startswith("1 more 'ring ignored' lines in the last 0 s")


def test_a_name_gone_between_the_listing_and_its_lstat_is_skipped_not_refused(finder: RingFinder,
                                                                               runtime_dir: Path) -> None:
    for i in range(2 * LISTING_SLICE):
        _make(runtime_dir, f"{i:05d}-r0.ring")

    def remove_all() -> None:  # after 1,024 names; the next are read already (a few hundred a getdents call)
        for name in os.listdir(runtime_dir):
            os.unlink(runtime_dir / name)

    assert len(list(finder.listing(between=remove_all))) == LISTING_SLICE - 1
    assert finder.refused.counts() == _counts()


def test_a_closed_finder_looks_at_nothing_and_says_the_dropped_lines(
        runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    _make(elsewhere, "cwd-r0.ring")  # a ring where a closed descriptor (-1) would list: the working directory
    monkeypatch.chdir(elsewhere)
    for i in range(25):
        _make(runtime_dir, f"{i:02d}-r0.ring", 0o644)
    finder = RingFinder(runtime_dir)
    gc.collect()  # descriptors other tests left to the collector are closed now, not during the count
    before = len(os.listdir("/proc/self/fd"))
    assert list(finder.listing()) == [] and finder.refused.counts() == _counts(mode=25)
    assert len(_said(caplog)) == 20  # the log's limit
    finder.close()
    summary = _said(caplog)[20:]  # the 5 past the limit, said at the close
    assert len(summary) == 1 and summary[0].startswith("5 more 'ring ignored' lines in the last ")
    assert summary[0].endswith(": mode 644 lets every user read it)") and f"(the last: ignoring ring {runtime_dir}/" \
        in summary[0]
    assert finder.dir_fd == -1 and finder.state_fd is None and len(os.listdir("/proc/self/fd")) == before - 2
    assert list(finder.listing()) == []
    assert list(finder.candidates()) == []
    assert _said(caplog)[-1] == f"cannot look at {runtime_dir}: [Errno 9] Bad file descriptor"
    finder.close()  # a second close closes nothing


def _same_dir(fd: int, path: Path) -> bool:
    info, there = os.fstat(fd), os.stat(path)
    return (info.st_dev, info.st_ino) == (there.st_dev, there.st_ino)


def test_a_private_runtime_directory_is_its_own_state_directory_and_given_descriptors_are_copied(
        runtime_dir: Path, tmp_path: Path) -> None:
    _make(runtime_dir, "a-r0.ring")
    private = RingFinder(runtime_dir)
    try:
        assert _same_dir(private.dir_fd, runtime_dir) and private.state_fd is not None
        assert private.state_fd != private.dir_fd and _same_dir(private.state_fd, runtime_dir)
    finally:
        private.close()
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    given, given_state = os.open(runtime_dir, os.O_RDONLY | os.O_DIRECTORY), os.open(state, os.O_RDONLY)
    finder = RingFinder(runtime_dir, runtime_fd=given, state_fd=given_state)
    os.close(given)  # copies: the caller's descriptors are the caller's to close
    os.close(given_state)
    try:
        assert finder.state_fd is not None and _same_dir(finder.state_fd, state)
        assert list(finder.listing()) == ["a-r0.ring"]
    finally:
        finder.close()


@pytest.mark.parametrize("mode", [0o3770, 0o750, 0o701])
def test_a_runtime_directory_others_may_enter_has_no_state_directory_by_default(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chmod(directory, mode)
    finder = RingFinder(directory)
    try:
        assert finder.state_fd is None and _same_dir(finder.dir_fd, directory)
    finally:
        finder.close()


def test_a_runtime_directory_of_another_uid_has_no_state_directory_and_trusted_uids_come_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, UNTRUSTED, -1)
    _make(directory, "u-r0.ring", uid=UNTRUSTED)
    monkeypatch.setenv("MEMWATCH_TRUST_UIDS", str(UNTRUSTED))
    finder = RingFinder(directory)
    try:
        assert finder.state_fd is None and UNTRUSTED in finder.trusted
        assert list(finder.listing()) == ["u-r0.ring"]
    finally:
        finder.close()


def test_open_takes_a_trusted_ring_and_refuses_what_was_opened_for_what_it_is(
        finder: RingFinder, runtime_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    _make(runtime_dir, "a-r0.ring")
    _make(runtime_dir, "open-r0.ring", 0o604)
    os.mkfifo(runtime_dir / "fifo-r0.ring", 0o600)
    gc.collect()  # descriptors other tests left to the collector are closed now, not during the count
    before = len(os.listdir("/proc/self/fd"))
    opened = finder.open("a-r0.ring")
    assert opened is not None
    fd, info = opened
    assert (info.st_dev, info.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == (
        os.stat(runtime_dir / "a-r0.ring").st_dev, os.stat(runtime_dir / "a-r0.ring").st_ino)
    os.close(fd)
    assert finder.open("open-r0.ring") is None  # opened, judged by fstat, closed again
    assert finder.open("fifo-r0.ring") is None  # never opened: a FIFO would wait for a writer
    assert finder.open("gone-r0.ring") is None
    assert len(os.listdir("/proc/self/fd")) == before  # nothing refused stays open
    assert finder.refused.counts() == _counts(mode=1, unreadable=2)
    assert _said(caplog) == [
        f"ignoring ring {runtime_dir}/open-r0.ring: mode 604 lets every user read it",
        f"ignoring ring {runtime_dir}/fifo-r0.ring: not a regular file (a FIFO)",
        f"ignoring ring {runtime_dir}/gone-r0.ring: No such file or directory"]


def test_a_stored_ring_is_removed_only_while_its_name_denotes_the_file_read(
        finder: RingFinder, runtime_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    ring = _make(runtime_dir, "a-r0.ring")
    read = os.stat(ring)
    os.replace(_make(runtime_dir, "b-r0.ring"), ring)  # the same name, another file: not the one read
    assert finder.unlink("a-r0.ring", (read.st_dev, read.st_ino)) is True and ring.exists()
    now = os.stat(ring)
    assert finder.unlink("a-r0.ring", (now.st_dev, now.st_ino)) is True and not ring.exists()
    long = "x" * 300 + ".ring"
    assert finder.unlink(long, (read.st_dev, read.st_ino)) is False  # the kernel refused: said, and kept
    assert _said(caplog) == [
        f"cannot remove the stored ring {runtime_dir / long}: File name too long; run the sidecar as the runtime "
        "directory's owner (or root) so that it can"]
    for _ in range(20):  # limited on their own: 20 a minute, past the refusals' lines
        finder.unlink(long, (read.st_dev, read.st_ino))
    finder.refuse("other-r0.ring", "a refusal of its own kind")
    finder.close()
    said = _said(caplog)
    assert len(said) == 1 + 19 + 1 + 1  # 20 said, a refusal in a window of its own, and the one past the limit
    assert said[-2] == f"ignoring ring {runtime_dir}/other-r0.ring: a refusal of its own kind"
    assert said[-1].startswith("1 more 'ring not removed' lines in the last ")


def test_a_listing_skips_names_refused_already_forgets_those_gone_and_lets_other_work_in_every_1024_names(
        finder: RingFinder, runtime_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    rings = {_make(runtime_dir, f"{i:05d}-r0.ring").name for i in range(2 * LISTING_SLICE + 5)}
    _make(runtime_dir, "notes.txt")
    _make(runtime_dir, "open-r0.ring", 0o644)
    gone = _make(runtime_dir, "gone-r0.ring", 0o644)
    os.symlink("00000-r0.ring", runtime_dir / "link-r0.ring")  # judged as a link, not as the ring it names
    calls: list[int] = []

    def between() -> None:  # e.g. the loop's open, refusing a ring of another directory's name meanwhile
        calls.append(1)
        finder.refuse(f"meanwhile{len(calls)}-r0.ring", "refused during the listing", "invalid")

    assert set(finder.listing(between=between)) == rings
    assert len(calls) == 2  # 2,057 names: after the 1,024th and the 2,048th
    assert finder.refused.counts() == _counts(mode=2, invalid=2, not_regular=1)
    gone.unlink()
    caplog.clear()
    assert set(finder.listing()) == rings
    # Not judged (nor said) again; the one gone forgotten, those refused during the last listing too (not listed).
    assert _said(caplog) == [] and finder.refused.counts() == _counts(mode=1, not_regular=1)
    assert "open-r0.ring" in finder.refused and "gone-r0.ring" not in finder.refused


def test_a_descriptor_that_is_no_directory_is_said_and_forgets_no_refusal(
        runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    regular = tmp_path / "not-a-directory"
    regular.write_text("")
    fd = os.open(regular, os.O_RDONLY)
    finder = RingFinder(runtime_dir, runtime_fd=fd)
    os.close(fd)
    try:
        finder.refuse("x-r0.ring", "refused before", "mode")
        assert list(finder.candidates()) == []
        assert finder.refused.counts() == _counts(mode=1)  # a listing that failed saw nothing go
        assert re.fullmatch(rf"cannot list {re.escape(str(runtime_dir))}: \[Errno 20\] Not a directory: '\.'",
                            _said(caplog)[-1])
    finally:
        finder.close()
