"""Three properties of an untrusted snapshot read that no answer shows: the raw bytes' descriptor is never
inherited by a program started meanwhile, a finished reader is forgotten, and a reader that closed its output is
given up at the wall-time limit itself, not at the next whole second of polling."""

from __future__ import annotations

import fcntl
import time

import pytest

from memwatch.snapshot import untrusted
from memwatch.snapshot.untrusted import Limits, parse_in_child

LINGER = "import os, time\nos.close(1)\ntime.sleep(30)\n"


def test_the_bytes_given_to_the_reader_are_in_a_descriptor_closed_on_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reader gets the descriptor as its stdin (Popen dups it there); any other program started while it is
    # open, by any thread, must not inherit the bytes.
    seen: list[int] = []

    def record(fd: int, name: str, limits: Limits, run_as: object) -> tuple[object, str]:
        seen.append(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)
        raise untrusted.UsageError("stop")

    monkeypatch.setattr(untrusted, "_in_child", record)
    with pytest.raises(untrusted.UsageError):
        parse_in_child(b"x", "f.pickle")
    assert seen == [fcntl.FD_CLOEXEC]


def test_a_finished_reader_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # stop_readers() kills what is in the set: a reader that ended must have left it, or the set grows by one
    # process object per import for the sidecar's life.
    monkeypatch.setattr(untrusted, "CHILD_CODE", "import sys; sys.stdout.write('{\"ok\": false, \"error\": \"no\"}')")
    for _ in range(3):
        with pytest.raises(untrusted.UsageError, match=r"^no$"):
            parse_in_child(b"x", "f.pickle")
    assert untrusted._children == set()


def test_a_reader_that_closed_its_output_is_given_up_at_the_limit_not_a_second_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.2 s of wall time: the wait after the output closes must end at the deadline. Waiting a full polling
    # second past it would take at least 1 s; 0.9 s leaves 0.7 s for starting and killing the reader.
    monkeypatch.setattr(untrusted, "CHILD_CODE", LINGER)
    started = time.monotonic()
    with pytest.raises(untrusted.UsageError, match=r"took more than 0\.2s to read"):
        parse_in_child(b"x", "f.pickle", Limits(wall_s=0.2))
    assert time.monotonic() - started < 0.9
