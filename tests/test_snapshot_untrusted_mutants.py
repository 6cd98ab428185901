"""The parent side of an untrusted snapshot read, at its edges: how the file is opened and judged, what the
reading child is given and runs in, and how each way the child can answer or end is reported.

A stand-in reader (a few lines of Python run in place of the real child) answers what a test needs: its own
arguments and surroundings as an error text, a malformed or oversized answer, an exit code or a signal."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from memwatch.errors import NotFoundError, UsageError
from memwatch.snapshot import untrusted
from memwatch.snapshot.untrusted import (
    DEFAULT_LIMITS,
    Limits,
    checked,
    open_snapshot,
    parse_in_child,
    read_snapshot,
    stop_readers,
)

HINT = "give the pickle torch.cuda.memory._dump_snapshot wrote"
MEMORY_HINT = ("a snapshot takes about 5 times its size to load: record a shorter history "
               "(torch.cuda.memory._record_memory_history(max_entries=...))")

# What the stand-in reader reports about itself, as the error of a refused file.
REPORT = """
import json, os, sys
args = json.loads(sys.argv[1])
seen = {"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "isolated": sys.flags.isolated,
        "own_session": os.getsid(0) == os.getpid(), "stderr": os.readlink("/proc/self/fd/2"),
        "stdin": sys.stdin.buffer.read().decode("latin-1")}
sys.stdout.write(json.dumps({"ok": False, "error": json.dumps(seen)}))
"""


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Run the given code as the reading child instead of the real one."""
    return lambda code: monkeypatch.setattr(untrusted, "CHILD_CODE", code)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.pickle"
    path.write_bytes(b"0123456789")
    return path


def reported(path: Path, limits: Limits = DEFAULT_LIMITS) -> dict:
    with pytest.raises(UsageError) as refused:
        read_snapshot(path, limits)
    return json.loads(str(refused.value))


def refusal(raw: bytes = b"x", limits: Limits = DEFAULT_LIMITS, name: str = "f.pickle") -> str:
    with pytest.raises(UsageError) as refused:
        parse_in_child(raw, name, limits)
    return str(refused.value)


# --- the limits -------------------------------------------------------------------------------------------


def test_the_default_limits_are_256_mib_60_s_of_cpu_384_mib_of_memory_and_120_s_of_wall_time() -> None:
    assert Limits() == DEFAULT_LIMITS == Limits(size_bytes=268_435_456, cpu_s=60, memory_bytes=402_653_184,
                                                wall_s=120.0)


# --- opening ----------------------------------------------------------------------------------------------


def test_a_missing_file_is_not_found_under_its_shown_name(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError) as missing:
        open_snapshot(tmp_path / "gone.pickle")
    assert str(missing.value) == f"no snapshot file {tmp_path / 'gone.pickle'}; {HINT}"
    with pytest.raises(NotFoundError) as missing:
        open_snapshot(tmp_path / "gone.pickle", shown="oom.pickle")
    assert str(missing.value) == f"no snapshot file oom.pickle; {HINT}"


def test_a_symbolic_link_is_refused_not_followed(tmp_path: Path, small: Path) -> None:
    link = tmp_path / "link.pickle"
    link.symlink_to(small)
    with pytest.raises(UsageError) as refused:
        open_snapshot(link)
    assert str(refused.value) == f"{link} is a symbolic link; give the snapshot file itself"
    with pytest.raises(UsageError) as refused:
        open_snapshot(link, shown="shown.pickle")
    assert str(refused.value) == "shown.pickle is a symbolic link; give the snapshot file itself"


def test_another_open_error_names_the_path_and_the_reason(small: Path) -> None:
    below_a_file = small / "x.pickle"
    with pytest.raises(UsageError) as refused:
        open_snapshot(below_a_file)
    assert str(refused.value) == (f"cannot read {below_a_file}: Not a directory; "
                                  "check the path and its permissions")
    with pytest.raises(UsageError) as refused:
        open_snapshot(below_a_file, shown="s")
    assert str(refused.value) == "cannot read s: Not a directory; check the path and its permissions"


def test_a_name_is_opened_relative_to_the_directory_given(tmp_path: Path, small: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "small.pickle").write_bytes(b"other")
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = open_snapshot(Path("small.pickle"), dir_fd=directory)
    finally:
        os.close(directory)
    try:
        assert os.read(fd, 100) == b"0123456789"
        assert not os.get_inheritable(fd)  # a child started later does not get it by accident
        with pytest.raises(OSError):
            os.write(fd, b"x")  # read only
    finally:
        os.close(fd)


def test_a_fifo_without_a_writer_opens_at_once_and_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.pickle"
    os.mkfifo(fifo)

    def waited(*_: object) -> None:
        raise TimeoutError("the open waited for a writer")

    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(5)
    try:
        fd = open_snapshot(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    try:
        with pytest.raises(UsageError) as refused:
            checked(fd, "fifo.pickle", 100)
    finally:
        os.close(fd)
    assert str(refused.value) == f"fifo.pickle is not a regular file (a FIFO); {HINT}"


# --- judging the open descriptor --------------------------------------------------------------------------


@pytest.mark.parametrize(("opener", "kind"), [
    (lambda tmp: os.open("/dev/null", os.O_RDONLY), "a device"),
    (lambda tmp: os.open(tmp, os.O_RDONLY), "a directory"),
    (lambda tmp: os.dup(socket.socket(socket.AF_UNIX).detach()), "a socket"),
    (lambda tmp: os.eventfd(0), "not a plain file"),
])
def test_what_is_not_a_regular_file_is_named_by_its_kind(tmp_path: Path, opener: Callable[[Path], int],
                                                         kind: str) -> None:
    fd = opener(tmp_path)
    try:
        with pytest.raises(UsageError) as refused:
            checked(fd, "odd.pickle", 1 << 30)
    finally:
        os.close(fd)
    assert str(refused.value) == f"odd.pickle is not a regular file ({kind}); {HINT}"


def test_a_block_device_is_named_a_device() -> None:
    block = next((p for p in ("/dev/loop0", "/dev/loop1", "/dev/sda", "/dev/vda", "/dev/nvme0n1")
                  if os.path.exists(p) and stat.S_ISBLK(os.stat(p).st_mode)), None)
    if block is None:
        pytest.skip("no block device here")
    fd = os.open(block, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(UsageError) as refused:
            checked(fd, "b", 0)
    finally:
        os.close(fd)
    assert str(refused.value) == f"b is not a regular file (a device); {HINT}"


def test_an_empty_file_passes_a_zero_limit_and_the_check_gives_its_size(tmp_path: Path, small: Path) -> None:
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    for path, limit, size in ((empty, 0, 0), (small, 10, 10)):
        fd = open_snapshot(path)
        try:
            assert checked(fd, "f", limit).st_size == size
        finally:
            os.close(fd)
    fd = open_snapshot(small)
    try:
        with pytest.raises(UsageError) as refused:
            checked(fd, "f", 9)
    finally:
        os.close(fd)
    assert str(refused.value) == f"f is 10 bytes, more than the 9 a snapshot may have; {HINT}"


# --- what the reading child is given ----------------------------------------------------------------------


def test_the_child_gets_the_name_and_every_limit_the_file_on_stdin_and_nothing_else(
        reader: Callable[[str], None], small: Path) -> None:
    reader(REPORT)
    limits = Limits(size_bytes=10, cpu_s=7, memory_bytes=200 << 20, wall_s=30.0)
    seen = reported(small, limits)
    assert seen["args"] == {"name": str(small), "run_as": [65534, 65534], "size_bytes": 10, "cpu_s": 7,
                            "memory_bytes": 209_715_200, "wall_s": 30.0}
    assert seen["stdin"] == "0123456789"
    assert seen["env"] == {"LC_ALL": "C.UTF-8"}
    assert seen["cwd"] == "/"
    assert seen["isolated"] == 1
    assert seen["own_session"] is True
    assert seen["stderr"] == "/dev/null"


def test_as_root_the_child_reads_as_the_files_owner_and_nobody_for_roots_own_file(
        reader: Callable[[str], None], small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader(REPORT)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    os.chown(small, 0, 0)
    assert reported(small)["args"]["run_as"] == [65534, 65534]
    os.chown(small, 1234, 0)
    assert reported(small)["args"]["run_as"] == [1234, 65534]
    os.chown(small, 1, 0)
    assert reported(small)["args"]["run_as"] == [1, 65534]


def test_not_as_root_the_child_reads_as_whoever_runs_it(reader: Callable[[str], None], small: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    reader(REPORT)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert reported(small)["args"]["run_as"] is None


def test_bytes_given_to_parse_are_read_by_the_child_as_nobody(reader: Callable[[str], None],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    reader(REPORT)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    seen = json.loads(refusal(b"\x00abc" * 3, Limits(size_bytes=12), name="raw.pickle"))
    assert seen["stdin"] == "\x00abc" * 3
    assert seen["args"]["name"] == "raw.pickle"
    assert seen["args"]["run_as"] == [65534, 65534]
    assert seen["args"]["size_bytes"] == 12


# --- how the child's answer is taken ----------------------------------------------------------------------


def answering(text: str, exit_code: int = 0) -> str:
    return f"import sys; sys.stdout.write({text!r}); sys.stdout.flush(); sys.exit({exit_code})"


@pytest.mark.parametrize(("answer", "why"), [
    ('{"ok": false, "error": 5}', "TypeError"),
    ('{"ok": false}', "KeyError"),
    ("not json", "JSONDecodeError"),
    ("[1]", "AttributeError"),
    ('{"ok": false, "error": "\u00e9"}', "ValueError"),
])
def test_a_malformed_answer_is_refused_with_what_was_wrong(reader: Callable[[str], None], answer: str,
                                                           why: str) -> None:
    reader(answering(answer))
    assert refusal() == f"f.pickle could not be read (its reader answered badly: {why}); {HINT}"


def test_only_ok_true_counts_as_a_snapshot(reader: Callable[[str], None]) -> None:
    reader(answering('{"ok": 1, "error": "the reader said no"}'))
    assert refusal() == "the reader said no"


def test_the_reason_given_is_cut_at_8192_characters(reader: Callable[[str], None]) -> None:
    reader(answering(json.dumps({"ok": False, "error": "a" * 8192 + "b" * 10})))
    assert refusal() == "a" * 8192
    reader(answering(json.dumps({"ok": False, "error": "c" * 8191})))
    assert refusal() == "c" * 8191


def test_an_answer_of_exactly_18_mib_is_read_and_one_byte_more_is_not(reader: Callable[[str], None]) -> None:
    limit = 18 * 1024 * 1024
    reader(f"import sys; sys.stdout.write('x' * {limit})")
    assert refusal() == f"f.pickle could not be read (its reader answered badly: JSONDecodeError); {HINT}"
    reader(f"import sys; sys.stdout.write('x' * {limit + 1})")
    assert refusal() == f"f.pickle could not be read (its reader answered more than 18,874,368 bytes); {HINT}"


def test_an_answer_that_is_too_long_is_refused_even_if_the_reader_goes_on(reader: Callable[[str], None],
                                                                         tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    reader(f"import os, sys, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
           f"sys.stdout.write('x' * {(18 << 20) + 1}); sys.stdout.flush(); time.sleep(60)")
    started = time.monotonic()
    assert refusal(limits=Limits(wall_s=30)) == (
        f"f.pickle could not be read (its reader answered more than 18,874,368 bytes); {HINT}")
    assert time.monotonic() - started < 10
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # killed and reaped


# --- how the child's end is reported ----------------------------------------------------------------------


@pytest.mark.parametrize(("code", "limits", "reason", "hint"), [
    (3, Limits(), "it needed more than 384 MiB of memory", MEMORY_HINT),
    (3, Limits(memory_bytes=(100 << 20) + 1), "it needed more than 100 MiB of memory", MEMORY_HINT),
    (4, Limits(), "it could not give up root's privileges", HINT),
    (1, Limits(), "the reader exited with 1", HINT),
    (2, Limits(), "the reader exited with 2", HINT),
    (5, Limits(), "the reader exited with 5", HINT),
])
def test_an_exit_code_is_reported_with_its_reason(reader: Callable[[str], None], code: int, limits: Limits,
                                                  reason: str, hint: str) -> None:
    # A good-looking answer does not count when the reader did not exit 0.
    reader(answering('{"ok": false, "error": "looks fine"}', code))
    assert refusal(limits=limits) == f"f.pickle could not be read within the limits ({reason}); {hint}"


@pytest.mark.parametrize(("sig", "reason"), [
    (signal.SIGXCPU, "it used more than 7s of CPU time"),
    (signal.SIGKILL, "it used more than 7s of CPU time"),
    (signal.SIGTERM, "the reader exited with -15"),
    (signal.SIGSEGV, "the reader exited with -11"),
])
def test_a_reader_ended_by_a_signal_is_reported_with_its_reason(reader: Callable[[str], None], sig: int,
                                                                reason: str) -> None:
    default = "" if sig == signal.SIGKILL else f"signal.signal({int(sig)}, signal.SIG_DFL); "
    reader(f"import os, signal; {default}os.kill(os.getpid(), {int(sig)})")
    assert refusal(limits=Limits(cpu_s=7)) == f"f.pickle could not be read within the limits ({reason}); {HINT}"


@pytest.mark.parametrize(("wall_s", "shown"), [(0.5, "0.5"), (1.0, "1"), (1.25, "1.25")])
def test_a_reader_past_its_wall_time_is_killed_and_reported(reader: Callable[[str], None], tmp_path: Path,
                                                            wall_s: float, shown: str) -> None:
    pid_file = tmp_path / "pid"
    reader(f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    started = time.monotonic()
    assert refusal(limits=Limits(wall_s=wall_s)) == (
        f"f.pickle took more than {shown}s to read and was given up (the wall-time limit); {HINT}")
    took = time.monotonic() - started
    assert wall_s <= took < wall_s + 3
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_a_reader_that_closes_its_output_and_lingers_is_given_up_at_the_wall_time(
        reader: Callable[[str], None]) -> None:
    reader("import os, time; os.close(1); time.sleep(60)")
    started = time.monotonic()
    assert refusal(limits=Limits(wall_s=1.5)) == (
        f"f.pickle took more than 1.5s to read and was given up (the wall-time limit); {HINT}")
    assert 1.5 <= time.monotonic() - started < 4.5


def test_a_reader_that_answers_slowly_within_the_wall_time_is_heard(reader: Callable[[str], None]) -> None:
    reader("import sys, time; sys.stdout.write('{\"ok\": false, '); sys.stdout.flush(); time.sleep(1.3); "
           "sys.stdout.write('\"error\": \"slow but whole\"}')")
    assert refusal(limits=Limits(wall_s=20)) == "slow but whole"


# --- one at a time, and stopping ------------------------------------------------------------------------


def test_a_read_waits_for_the_one_before_at_most_its_wall_time_and_10_s(reader: Callable[[str], None],
                                                                       tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    reader(f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    errors: list[str] = []

    def read() -> None:
        try:
            parse_in_child(b"x", "long.pickle", Limits(cpu_s=9, wall_s=60))
        except UsageError as exc:
            errors.append(str(exc))

    first = threading.Thread(target=read)
    first.start()
    try:
        deadline = time.monotonic() + 10
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        started = time.monotonic()
        assert refusal(limits=Limits(wall_s=0.25)) == (
            "f.pickle was not read: another snapshot import did not end in time; try again")
        assert 10.25 <= time.monotonic() - started < 11.0
        assert first.is_alive()
        # stop_readers ends the first read at once, as if its reader had been killed at the CPU limit.
        started = time.monotonic()
        stop_readers()
        first.join(10)
        assert time.monotonic() - started < 3
    finally:
        stop_readers()
        first.join(60)
    assert errors == [f"long.pickle could not be read within the limits (it used more than 9s of CPU time); {HINT}"]
    # The lock is free again: the next read is not refused for waiting.
    reader(answering('{"ok": false, "error": "next"}'))
    assert refusal(limits=Limits(wall_s=0.25)) == "next"
    stop_readers()  # nothing left to stop
