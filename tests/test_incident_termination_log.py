"""The container's termination message, in process on real files: the exact lines, which of them fit in 4 KiB, what
is never written through (a link, a FIFO, a missing file, a full disk), and the folder it may be written in.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import stat
from pathlib import Path

import pytest

from memwatch.errors import PermissionDeniedError
from memwatch.incident.ship import Shipped, TerminationMessage, check_termination_folder

LOGGER = "memwatch.incident"


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_the_termination_message_names_each_bundle_newest_last(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    log = tmp_path / "termination-log"
    log.write_text("the previous container's message, longer than what follows\n" * 3)
    message = TerminationMessage(log)
    message(Shipped("a", "file:///b/a", "oom", "r1", 10, "oom"))
    assert log.read_text() == "memwatch incident: oom (oom) file:///b/a\n"
    message(Shipped("b", "s3://k/b", "problems", "r2", 10))
    assert log.read_text() == "memwatch incident: oom (oom) file:///b/a\nmemwatch incident: problems (unknown) s3://k/b\n"
    for i in range(70):  # short lines: 64 are kept, all within 4 KiB
        message(Shipped("c", f"u{i:02d}", "ok", "r", 1, "manual"))
    lines = log.read_text().splitlines()
    assert len(lines) == 64 and lines[0] == "memwatch incident: ok (manual) u06" and lines[-1].endswith(" u69")
    message.close()
    message.close()
    message(Shipped("d", "u", "ok", "r", 1))  # closed: nothing more is written, nothing tried
    assert len(log.read_text().splitlines()) == 64 and logged(caplog) == []


def test_a_termination_folder_opened_as_descriptor_0_is_written_and_closed(tmp_path: Path) -> None:
    # A sidecar started with stdin closed: the folder's descriptor is 0, the lowest free one.
    log = tmp_path / "termination-log"
    log.write_text("")
    saved = os.dup(0)
    os.close(0)
    try:
        message = TerminationMessage(log)
        message(Shipped("a", "file:///b/a", "oom", "r1", 10, "oom"))
        assert log.read_text() == "memwatch incident: oom (oom) file:///b/a\n"
        message.close()
        with pytest.raises(OSError):
            os.fstat(0)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
    nothing = TerminationMessage(None)
    nothing(Shipped("a", "file:///b/a", "oom", "r1", 10, "oom"))
    nothing.close()  # holds no descriptor: closes none
    os.fstat(1)


def _line_of(nbytes: int, fill: str = "p") -> Shipped:
    """A bundle whose termination line is ``nbytes`` bytes with its newline (``fill`` may take 2 bytes)."""
    head = len("memwatch incident: oom (oom) \n")
    return Shipped("n", fill * ((nbytes - head) // len(fill.encode())), "oom", "r", 1, "oom")


def test_the_termination_message_keeps_whole_lines_within_4096_bytes(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")
    exact = TerminationMessage(log)
    exact(_line_of(2048))
    exact(_line_of(2048, "é"))  # 2,048 bytes of 1,039 characters: bytes are what count
    assert len(log.read_bytes()) == 4096 and len(log.read_text().splitlines()) == 2
    exact(_line_of(2048))
    assert len(log.read_bytes()) == 4096  # the oldest went
    over = TerminationMessage(log)
    for nbytes in (100, 2000, 2048, 2049):
        over(_line_of(nbytes))
    # Newest first: 2,049 + 2,048 = 4,097 bytes: the newest alone, nor anything older behind the one that failed.
    assert log.read_bytes() == f"memwatch incident: oom (oom) {'p' * 2019}\n".encode()
    huge = TerminationMessage(log)
    huge(Shipped("n", "x" + "é" * 3000, "oom", "r", 1, "oom"))
    # Over 4 KiB alone: its first 4,095 bytes (29 of text, "x", then 2,032 "é" and half of one, dropped) and "\n".
    assert log.read_text() == "memwatch incident: oom (oom) x" + "é" * 2032 + "\n"
    huge(Shipped("n", "y" * 5000, "oom", "r", 1, "oom"))  # cut between two characters: 4,095 bytes, all kept
    assert log.read_text() == "memwatch incident: oom (oom) " + "y" * 4066 + "\n"


def test_no_termination_message_through_a_link_a_fifo_or_a_missing_file(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    shipped = Shipped("n", "file:///s/n", "oom", "r", 1, "oom")
    absent = TerminationMessage(tmp_path / "nofolder" / "termination-log")
    absent(shipped)
    assert not (tmp_path / "nofolder").exists()
    TerminationMessage(tmp_path / "missing")(shipped)
    (tmp_path / "secret").write_text("keep")
    (tmp_path / "link").symlink_to(tmp_path / "secret")
    TerminationMessage(tmp_path / "link")(shipped)
    assert (tmp_path / "secret").read_text() == "keep"
    os.mkfifo(tmp_path / "fifo")
    TerminationMessage(tmp_path / "fifo")(shipped)  # no reader: never waited for
    reader = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    try:
        TerminationMessage(tmp_path / "fifo")(shipped)
        assert os.read(reader, 100) == b""
    finally:
        os.close(reader)
    full = tmp_path / "full"
    full.write_text("old")
    message = TerminationMessage(full)
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, limit[1]))  # a file system with no room left for it
    try:
        message(shipped)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert logged(caplog) == [
        f"no termination message at {tmp_path / 'nofolder' / 'termination-log'}: No such file or directory",
        f"no termination message at {tmp_path / 'missing'}: No such file or directory",
        f"no termination message at {tmp_path / 'link'}: Too many levels of symbolic links",
        f"no termination message at {tmp_path / 'fifo'}: No such device or address",
        f"no termination message at {tmp_path / 'fifo'}: not a regular file",
        f"cannot write the termination message {full}: File too large"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another uid")
def test_a_termination_folder_others_may_write_is_refused_and_a_private_one_taken(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    assert check_termination_folder(tmp_path / "afile" / "termination-log") == -1  # not a folder: nothing to write
    assert check_termination_folder(tmp_path / "none" / "termination-log") == -1
    for mode, owner, why in ((0o775, 0, "can be written by other users (mode 775)"),
                             (0o757, 0, "can be written by other users (mode 757)"),
                             (0o1777, 0, "can be written by other users (mode 1777)"),
                             (0o700, 1, "belongs to uid 1")):
        folder = tmp_path / f"dev-{mode:o}-{owner}"
        folder.mkdir()
        os.chown(folder, owner, 0)
        folder.chmod(mode)
        with pytest.raises(PermissionDeniedError) as refused:
            check_termination_folder(folder / "termination-log")
        assert str(refused.value) == (
            f"--termination-log {folder / 'termination-log'}: its folder {folder} {why}; give a file in a folder only "
            "root or this user can write (Kubernetes: /dev/termination-log)")
    for mode in (0o755, 0o711, 0o700):
        folder = tmp_path / f"ok-{mode:o}"
        folder.mkdir()
        folder.chmod(mode)
        fd = check_termination_folder(folder / "termination-log")
        assert stat.S_ISDIR(os.fstat(fd).st_mode) and os.fstat(fd).st_ino == folder.stat().st_ino
        os.close(fd)
