"""A bundle's scratch files live in a private folder inside the folder it is published to, reached by descriptor."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from memwatch.incident import scratch
from memwatch.incident.scratch import WorkDir, remove_leftovers


@pytest.fixture
def out(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    folder = tmp_path / "incidents"
    folder.mkdir(mode=0o700)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    yield folder, fd
    os.close(fd)


def test_a_work_folder_is_private_named_for_the_process_and_reached_through_its_descriptor(out) -> None:
    folder, fd = out
    with WorkDir(fd) as work:
        [made] = list(folder.iterdir())
        assert made.name == work.name
        assert work.name.startswith(f".work-{os.getpid()}-") and len(work.name) == len(f".work-{os.getpid()}-") + 16
        info = made.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        assert work.path("run.db") == f"/proc/self/fd/{work.fd}/run.db"
        conn = sqlite3.connect(work.path("run.db"))
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
        conn.close()
        os.rename(made, folder / "moved")  # the path changes; the descriptor still reaches the folder
        assert os.listdir(work.fd) == ["run.db"]
        os.rename(folder / "moved", made)
    assert list(folder.iterdir()) == []
    assert work.fd == -1
    work.close()  # twice is harmless


def test_two_work_folders_of_one_process_do_not_collide(out) -> None:
    _, fd = out
    with WorkDir(fd) as a, WorkDir(fd) as b:
        assert a.name != b.name


def test_a_name_already_there_even_a_symlink_is_never_used(out, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    folder, fd = out
    target = tmp_path / "elsewhere"
    target.mkdir()
    monkeypatch.setattr(scratch.secrets, "token_hex", lambda n: "0" * (2 * n))
    (folder / f".work-{os.getpid()}-{'0' * 16}").symlink_to(target)
    with pytest.raises(FileExistsError):
        WorkDir(fd)
    assert list(target.iterdir()) == []


def test_a_work_folder_others_may_enter_is_refused_and_removed(out, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, fd = out
    real_mkdir = os.mkdir
    old = os.umask(0)
    try:
        monkeypatch.setattr(scratch.os, "mkdir", lambda name, mode, dir_fd: real_mkdir(name, 0o755, dir_fd=dir_fd))
        with pytest.raises(PermissionError, match="lets other users in") as refused:
            WorkDir(fd)
        assert refused.value.filename.startswith(f".work-{os.getpid()}-")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert list(folder.iterdir()) == []


def test_a_work_folder_that_cannot_be_opened_is_removed(out, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, fd = out

    def refuse(name: str, dir_fd: int) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(scratch, "open_dir", refuse)
    with pytest.raises(OSError, match="Too many open files"):
        WorkDir(fd)
    assert list(folder.iterdir()) == []


def test_leftovers_of_builds_cut_short_are_removed_and_nothing_else(out, caplog: pytest.LogCaptureFixture) -> None:
    folder, fd = out
    keep = ["run1.tar.gz", ".building-run2.tmp", "work-13", "x.part"] + [f"other-{i}" for i in range(20)]
    for name in keep[:12]:  # names to keep on both sides of the leftovers, whatever order the folder lists
        (folder / name).write_bytes(b"kept")
    (folder / ".work-12-abc").mkdir()
    (folder / ".work-12-abc" / "run.db").write_bytes(b"x" * 100)
    (folder / ".work-12-abc" / "sub").mkdir()
    (folder / ".building-run1.part").write_bytes(b"half")
    for name in keep[12:]:
        (folder / name).write_bytes(b"kept")
    with caplog.at_level(logging.WARNING, logger="memwatch.incident"):
        removed = remove_leftovers(fd)
    assert sorted(removed) == [".building-run1.part", ".work-12-abc"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(keep)
    [line] = [r.getMessage() for r in caplog.records]
    assert line == "removed 2 leftover(s) of bundle builds cut short: .building-run1.part, .work-12-abc"


def test_no_leftovers_is_silent(out, caplog: pytest.LogCaptureFixture) -> None:
    _, fd = out
    with caplog.at_level(logging.WARNING, logger="memwatch.incident"):
        assert remove_leftovers(fd) == []
    assert caplog.records == []


def test_a_leftover_that_cannot_be_removed_is_named_and_the_rest_still_go(out, caplog: pytest.LogCaptureFixture,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder, fd = out
    (folder / ".building-a.part").write_bytes(b"1")
    (folder / ".work-1-x").mkdir()

    def refuse(name: str, dir_fd: int) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(scratch.shutil, "rmtree", refuse)
    listed = os.listdir(fd)
    monkeypatch.setattr(scratch.os, "listdir", lambda _: sorted(listed, reverse=True))  # the one refused first
    with caplog.at_level(logging.WARNING, logger="memwatch.incident"):
        assert remove_leftovers(fd) == [".building-a.part"]
    monkeypatch.undo()
    assert (folder / ".work-1-x").is_dir() and not (folder / ".building-a.part").exists()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["cannot remove .work-1-x, left by a bundle build cut short: Permission denied",
                     "removed 1 leftover(s) of bundle builds cut short: .building-a.part"]


def test_a_work_folder_on_descriptor_0_is_closed_too(out) -> None:
    """A daemon started with its standard input closed gets descriptor 0 for the first file it opens."""
    _, fd = out
    saved = os.dup(0)
    os.close(0)
    try:
        work = WorkDir(fd)
        assert work.fd == 0
        work.close()
        with pytest.raises(OSError):
            os.fstat(0)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
