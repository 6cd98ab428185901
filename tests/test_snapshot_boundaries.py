"""A snapshot file's reader at its limits: exactly the size limit is read and one byte more is not, whether the
byte is there at the check or appears while the child reads; a child the kernel kills with SIGKILL at the CPU
limit's hard edge is reported as having used too much CPU time."""

from __future__ import annotations

import hashlib
import os
import pickle
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_snapshot_import import snapshot

from memwatch.errors import UsageError
from memwatch.snapshot.untrusted import Limits, checked, open_snapshot, parse_in_child, read_open, read_snapshot


@pytest.fixture
def pickled(tmp_path: Path) -> tuple[Path, bytes]:
    """A valid snapshot file and its bytes."""
    raw = pickle.dumps(snapshot(oom_us=2_000_000, grow_us=1_000_000))
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(raw)
    return path, raw


def test_a_file_of_exactly_the_size_limit_is_read_and_one_byte_over_is_refused(pickled: tuple[Path, bytes]) -> None:
    path, raw = pickled
    size = len(raw)
    # At the limit: read whole, and the hash covers every byte of the file.
    _, sha = read_snapshot(path, Limits(size_bytes=size))
    assert sha == hashlib.sha256(raw).hexdigest()
    # A limit one byte smaller than the file: refused by the check, before any child runs.
    with pytest.raises(UsageError) as refused:
        read_snapshot(path, Limits(size_bytes=size - 1))
    assert str(refused.value) == (f"{path} is {size:,} bytes, more than the {size - 1:,} a snapshot may have; "
                                  "give the pickle torch.cuda.memory._dump_snapshot wrote")


def test_a_file_that_grows_past_the_limit_while_it_is_read_is_refused(pickled: tuple[Path, bytes]) -> None:
    path, raw = pickled
    size = len(raw)
    fd = open_snapshot(path)
    try:
        info = checked(fd, "grows.pickle", size)  # exactly at the limit when checked
        with path.open("ab") as grow:
            grow.write(b"\0")  # one byte past the limit by the time the child reads
        with pytest.raises(UsageError) as refused:
            read_open(fd, info, "grows.pickle", Limits(size_bytes=size))
    finally:
        os.close(fd)
    assert str(refused.value) == (f"grows.pickle grew past the {size:,} bytes a snapshot may have while it was read; "
                                  "give the pickle torch.cuda.memory._dump_snapshot wrote")


@pytest.fixture
def sigxcpu_ignored() -> Iterator[None]:
    """SIGXCPU ignored here, so the reading child inherits it ignored (a shell or a container can start the
    sidecar so): its soft CPU limit then passes unnoticed and the kernel kills it at the hard limit with SIGKILL."""
    previous = signal.signal(signal.SIGXCPU, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGXCPU, previous)


@pytest.mark.usefixtures("sigxcpu_ignored")
def test_a_reader_killed_by_sigkill_at_the_hard_cpu_limit_is_said_to_have_used_too_much_cpu() -> None:
    # 1,000,000 trace entries take about 4 s of CPU to walk (4 µs each), past the hard limit of 1 + 1 = 2 s.
    entry = {"action": "alloc", "addr": 1, "size": 2, "stream": 0, "time_us": 5,
             "frames": [{"filename": "a.py", "line": 1, "name": "f"}]}
    raw = pickle.dumps({"segments": [], "device_traces": [[entry] * 1_000_000]})
    started = time.monotonic()
    with pytest.raises(UsageError) as stopped:
        parse_in_child(raw, "slow.pickle", Limits(cpu_s=1, wall_s=60))
    assert str(stopped.value) == ("slow.pickle could not be read within the limits (it used more than 1s of CPU "
                                  "time); give the pickle torch.cuda.memory._dump_snapshot wrote")
    assert time.monotonic() - started < 60
