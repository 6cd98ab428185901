"""The descriptor-relative file operations memwatch uses in folders another uid can write (often as root).

Each test puts on disk what a hostile writer could (a symlink, a FIFO, a folder, a file of another uid, a
leftover of a killed writer) and checks what the operation does with it: refuses it with a reason, or acts
on the file it judged and on nothing else.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from memwatch_engine import dirfd
from memwatch_engine.dirfd import (
    NotRegularFile,
    check_private,
    create_exclusive,
    file_id,
    list_names,
    open_regular,
    private_dir,
    private_subdir,
    read_small,
    replace_file,
    unlink_if_same,
)

OTHER_UID = 65534


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield tmp_path, fd
    os.close(fd)


def _refusal(fd: int, name: str) -> NotRegularFile:
    with pytest.raises(NotRegularFile) as refused:
        open_regular(fd, name)
    return refused.value


def test_open_regular_opens_a_plain_file_and_says_what_it_opened(folder: tuple[Path, int]) -> None:
    path, fd = folder
    (path / "plain").write_bytes(b"12345")
    opened, info = open_regular(fd, "plain")
    try:
        assert os.read(opened, 100) == b"12345"
        assert stat.S_ISREG(info.st_mode) and info.st_size == 5
        assert file_id(info) == (path.stat().st_dev, (path / "plain").stat().st_ino)
        # Opened with no symlink followed, never blocking, closed on exec.
        status = os.get_blocking(opened), os.get_inheritable(opened)
        assert status == (False, False)
    finally:
        os.close(opened)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b"])
def test_a_name_that_is_not_one_entry_is_refused_before_anything_is_looked_up(folder: tuple[Path, int],
                                                                                name: str) -> None:
    refused = _refusal(folder[1], name)
    assert refused.errno == errno.EINVAL and refused.strerror == "not a plain file name" and refused.filename == name


def test_a_symlink_a_fifo_and_a_folder_are_refused_each_named(folder: tuple[Path, int]) -> None:
    path, fd = folder
    (path / "target").write_bytes(b"secret")
    (path / "link").symlink_to(path / "target")
    os.mkfifo(path / "fifo")
    (path / "sub").mkdir()
    assert _refusal(fd, "link").strerror == "not a regular file (a symlink)"
    assert _refusal(fd, "fifo").strerror == "not a regular file (a FIFO)"  # and the open never blocked on it
    assert _refusal(fd, "sub").strerror == "not a regular file (a directory)"
    assert (_refusal(fd, "link").errno, _refusal(fd, "fifo").filename) == (errno.EINVAL, "fifo")


def test_the_kind_of_every_other_file_is_named() -> None:
    assert dirfd._kind(stat.S_IFCHR) == "a device" and dirfd._kind(stat.S_IFBLK) == "a device"
    assert dirfd._kind(stat.S_IFSOCK) == "a socket"
    assert dirfd._kind(stat.S_IFREG) == "not a regular file"


def test_a_file_swapped_for_a_folder_between_the_look_and_the_open_is_refused_and_closed(
        folder: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    path, fd = folder
    (path / "swapped").mkdir()
    real_stat = os.stat
    (path / "plain").write_bytes(b"")
    looked = real_stat(path / "plain")
    # What the first look saw was a plain file; what is opened under the name is a folder.
    monkeypatch.setattr(os, "stat", lambda name, **kw: looked if name == "swapped" else real_stat(name, **kw))
    opened_before = set(os.listdir("/proc/self/fd"))
    refused = _refusal(fd, "swapped")
    monkeypatch.undo()
    assert (refused.errno, refused.strerror, refused.filename) == (errno.EINVAL, "not a regular file (a directory)",
                                                                  "swapped")
    assert set(os.listdir("/proc/self/fd")) == opened_before  # the descriptor of what was opened is closed


def test_create_exclusive_takes_nothing_that_is_there_and_sets_the_mode_whatever_the_umask(
        folder: tuple[Path, int]) -> None:
    path, fd = folder
    old = os.umask(0o777)
    try:
        made = create_exclusive(fd, "new", 0o640)
    finally:
        os.umask(old)
    os.close(made)
    assert stat.S_IMODE((path / "new").stat().st_mode) == 0o640
    (path / "dangling").symlink_to(path / "nowhere")
    with pytest.raises(FileExistsError):
        create_exclusive(fd, "dangling", 0o600)
    assert not (path / "nowhere").exists()  # not created through the link
    with pytest.raises(FileExistsError):
        create_exclusive(fd, "new", 0o600)


def test_read_small_reads_at_most_its_limit_and_only_from_the_owner_asked(folder: tuple[Path, int]) -> None:
    path, fd = folder
    (path / "big").write_bytes(b"x" * 5000)
    assert len(read_small(fd, "big")) == 4096 == dirfd.READ_LIMIT
    assert read_small(fd, "big", limit=10) == b"x" * 10
    assert len(read_small(fd, "big", owner=os.geteuid())) == 4096
    os.chown(path / "big", OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError) as refused:
        read_small(fd, "big", owner=os.geteuid())
    assert refused.value.strerror == f"owned by uid {OTHER_UID}, not {os.geteuid()}"
    assert refused.value.errno == errno.EPERM
    assert refused.value.filename == "big"
    assert len(read_small(fd, "big")) == 4096  # no owner asked: anyone's


def test_replace_file_writes_whole_over_a_leftover_and_the_old_file_with_the_mode_given(
        folder: tuple[Path, int]) -> None:
    path, fd = folder
    (path / "state").write_bytes(b"old, longer than the new")
    (path / ".state.tmp").write_bytes(b"left by a writer killed mid-write")
    replace_file(fd, "state", b"new", mode=0o640)
    assert (path / "state").read_bytes() == b"new"
    assert stat.S_IMODE((path / "state").stat().st_mode) == 0o640
    assert sorted(os.listdir(path)) == ["state"]
    replace_file(fd, "state", b"newer")
    assert stat.S_IMODE((path / "state").stat().st_mode) == 0o600


def test_unlink_if_same_removes_only_the_file_it_judged(folder: tuple[Path, int]) -> None:
    path, fd = folder
    (path / "judged").write_bytes(b"")
    ident = file_id(os.stat(path / "judged"))
    (path / "judged").rename(path / "kept")  # kept, so its inode cannot be reused by the next file
    assert unlink_if_same(fd, "judged", ident) is False  # nothing under the name
    (path / "judged").write_bytes(b"another file under the name")
    assert unlink_if_same(fd, "judged", ident) is False
    assert (path / "judged").exists() and (path / "kept").exists()
    assert unlink_if_same(fd, "judged", file_id(os.stat(path / "judged"))) is True
    assert not (path / "judged").exists()


def test_unlink_if_same_says_false_when_the_name_goes_between_the_look_and_the_removal(
        folder: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    path, fd = folder
    (path / "racing").write_bytes(b"")
    ident = file_id(os.stat(path / "racing"))
    real_unlink = os.unlink

    def gone_first(name: str, **kw: object) -> None:
        real_unlink(name, **kw)
        real_unlink(name, **kw)

    monkeypatch.setattr(os, "unlink", gone_first)
    assert unlink_if_same(fd, "racing", ident) is False


def test_private_dir_makes_the_folder_and_its_parents_0700(tmp_path: Path) -> None:
    made = private_dir(tmp_path / "a" / "b" / "c")
    try:
        assert os.fstat(made).st_ino == (tmp_path / "a" / "b" / "c").stat().st_ino
        assert os.get_inheritable(made) is False
    finally:
        os.close(made)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    parent = os.open(tmp_path / "a", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.close(private_subdir(parent, "d"))  # made when missing unless asked not to
    finally:
        os.close(parent)
    assert stat.S_IMODE((tmp_path / "a" / "d").stat().st_mode) == 0o700


def test_private_dir_without_create_makes_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        private_dir(tmp_path / "a" / "b", create=False)
    assert not (tmp_path / "a").exists()
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileNotFoundError):
            private_subdir(parent, "c", create=False)
    finally:
        os.close(parent)
    assert not (tmp_path / "c").exists()
    with pytest.raises(FileNotFoundError):
        private_dir(tmp_path / "c", create=False)  # its parent is there: still nothing made
    assert not (tmp_path / "c").exists()


def test_a_folder_others_may_enter_or_another_uid_owns_or_a_link_to_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / "open").mkdir(mode=0o755)
    os.chmod(tmp_path / "open", 0o755)
    with pytest.raises(PermissionError) as refused:
        private_dir(tmp_path / "open")
    assert refused.value.strerror == "mode 755 lets other users in; chmod 700 it"
    assert (refused.value.errno, refused.value.filename) == (errno.EPERM, str(tmp_path / "open"))
    (tmp_path / "theirs").mkdir(mode=0o700)
    os.chown(tmp_path / "theirs", OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError) as refused:
        private_dir(tmp_path / "theirs")
    assert refused.value.strerror == f"belongs to uid {OTHER_UID}, not {os.geteuid()}"
    assert (refused.value.errno, refused.value.filename) == (errno.EPERM, str(tmp_path / "theirs"))
    (tmp_path / "mine").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    with pytest.raises(OSError) as refused:
        private_dir(tmp_path / "link")
    assert refused.value.errno in (errno.ELOOP, errno.ENOTDIR)


def test_a_subfolder_is_refused_under_the_name_shown_or_its_own(tmp_path: Path) -> None:
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o750)
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    opened_before = set(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(PermissionError) as refused:
            private_subdir(parent, "open")
        assert refused.value.filename == "open" and "mode 750" in refused.value.strerror
        with pytest.raises(PermissionError) as refused:
            private_subdir(parent, "open", shown="/where/the/user/named/it")
        assert refused.value.filename == "/where/the/user/named/it"
        assert set(os.listdir("/proc/self/fd")) == opened_before  # nothing left open
    finally:
        os.close(parent)


def test_check_private_refuses_a_file_where_a_folder_was_expected(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError) as refused:
        check_private(os.stat(tmp_path / "file"), tmp_path / "file")
    assert (refused.value.errno, refused.value.strerror, refused.value.filename) == (
        errno.ENOTDIR, "not a directory", str(tmp_path / "file"))
    (tmp_path / "private").mkdir(mode=0o700)
    os.chmod(tmp_path / "private", 0o700)
    assert check_private(os.stat(tmp_path / "private"), tmp_path / "private") is None


def test_list_names_lists_the_folder_and_leaves_no_descriptor_open(folder: tuple[Path, int]) -> None:
    path, fd = folder
    for name in ("a", "b", ".hidden"):
        (path / name).write_bytes(b"")
    opened_before = set(os.listdir("/proc/self/fd"))
    assert sorted(list_names(fd)) == [".hidden", "a", "b"]
    assert sorted(list_names(fd)) == [".hidden", "a", "b"]  # listing again starts from the top
    assert set(os.listdir("/proc/self/fd")) == opened_before


def test_a_listing_descriptor_is_a_folders_own_and_closed_on_exec(folder: tuple[Path, int]) -> None:
    path, fd = folder
    listing = dirfd.reopen_dir(fd)
    try:
        assert os.fstat(listing).st_ino == path.stat().st_ino and os.get_inheritable(listing) is False
    finally:
        os.close(listing)


def test_unlink_if_same_removes_a_symlink_judged_as_itself_and_nothing_it_points_to(
        folder: tuple[Path, int]) -> None:
    path, fd = folder
    (path / "target").write_bytes(b"kept")
    (path / "link").symlink_to(path / "target")
    (path / "dangling").symlink_to(path / "nowhere")
    assert unlink_if_same(fd, "link", file_id(os.lstat(path / "link"))) is True
    assert unlink_if_same(fd, "dangling", file_id(os.lstat(path / "dangling"))) is True
    assert sorted(os.listdir(path)) == ["target"]


def test_a_file_whose_mode_cannot_be_set_is_closed_and_the_error_raised(
        folder: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(fd: int, mode: int) -> None:
        raise PermissionError(errno.EPERM, "refused")

    monkeypatch.setattr(os, "fchmod", refused)
    opened_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(PermissionError):
        create_exclusive(folder[1], "new", 0o600)
    monkeypatch.undo()
    assert set(os.listdir("/proc/self/fd")) == opened_before
