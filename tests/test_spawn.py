"""Starting a sidecar from the engine: asked by lock only, never in a directory that is not ours alone, and
started detached (its own session, no child of the engine, its output in ``sidecar.log``) so the engine's
teardown of its process tree never takes it down."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from memwatch_engine.runtime import LOCK_NAME, LOG_NAME, PID_NAME, PRESENCE_NAME, SHARED_DIR_MODE
from memwatch_engine.spawn import IDLE_EXIT_SECONDS, ensure_sidecar, sidecar_pid, sidecar_running

from processes import memwatch_env, wait_for

OTHER_UID = 4321

HOLD_LAUNCHER = """
import os, sys, time
hold = os.environ.get("MEMWATCH_TEST_HOLD")
if hold and sys.argv[:1] == ["-c"]:  # the launcher, not the sidecar it starts (``-m memwatch``)
    with open(hold + ".pid", "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 20
    while not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.01)
"""
"""Made the ``sitecustomize`` of the processes the engine starts: the launcher waits at its start until the test
lets it go, so what it inherited, and the engine's thread waiting for it, can be looked at while it lives."""

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="a directory or file of another user is made with chown")


class Held:
    """A lock on a file of the directory, held by another open of it (as a sidecar holds its own)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))

    def release(self) -> None:
        os.close(self.fd)


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(SHARED_DIR_MODE)
    return directory


@pytest.fixture
def foreign_dir(tmp_path: Path) -> Path:
    """A private directory of another user's (0700): not ours to create files in."""
    directory = tmp_path / "foreign"
    directory.mkdir(mode=0o700)
    os.chown(directory, OTHER_UID, -1)
    return directory


def test_no_directory_and_no_lock_mean_no_sidecar(runtime_dir: Path, tmp_path: Path) -> None:
    assert not sidecar_running(tmp_path / "missing")
    assert not sidecar_running(runtime_dir)
    (runtime_dir / LOCK_NAME).write_text("")  # a lock file nobody holds: a sidecar that died
    assert not sidecar_running(runtime_dir)
    assert sorted(p.name for p in runtime_dir.iterdir()) == [LOCK_NAME]  # asking created nothing


@pytest.mark.parametrize("name", [LOCK_NAME, PRESENCE_NAME])
def test_a_held_lock_or_marker_in_our_directory_is_a_running_sidecar(runtime_dir: Path, name: str) -> None:
    held = Held(runtime_dir / name)
    try:
        assert sidecar_running(runtime_dir)
    finally:
        held.release()
    assert not sidecar_running(runtime_dir)


def test_in_a_shared_directory_only_the_agents_marker_counts(shared_dir: Path) -> None:
    held = Held(shared_dir / LOCK_NAME)  # anyone of the group could make and lock this one
    try:
        assert not sidecar_running(shared_dir)
        marker = Held(shared_dir / PRESENCE_NAME)
        try:
            assert sidecar_running(shared_dir)
        finally:
            marker.release()
    finally:
        held.release()


@needs_root
def test_in_another_users_directory_only_the_marker_counts(foreign_dir: Path) -> None:
    held = Held(foreign_dir / LOCK_NAME)
    try:
        assert not sidecar_running(foreign_dir)
    finally:
        held.release()


def test_the_pid_is_read_from_our_own_pid_file(runtime_dir: Path, tmp_path: Path) -> None:
    pid_file = runtime_dir / PID_NAME
    assert sidecar_pid(tmp_path / "missing") is None
    assert sidecar_pid(runtime_dir) is None  # no file
    for content, pid in (("4242 8812 auto\n", 4242), ("17\n", 17), ("", None), ("\n", None), ("pid\n", None)):
        pid_file.write_text(content)
        assert sidecar_pid(runtime_dir) == pid, content
    pid_file.write_text("1" * 300)  # only the first 256 bytes are read
    assert sidecar_pid(runtime_dir) == int("1" * 256)


def test_a_pid_file_in_a_shared_directory_is_not_read(shared_dir: Path) -> None:
    (shared_dir / PID_NAME).write_text("4242\n")  # any group member could have written it
    assert sidecar_pid(shared_dir) is None


@needs_root
def test_a_pid_file_of_another_user_is_not_read(runtime_dir: Path) -> None:
    pid_file = runtime_dir / PID_NAME
    pid_file.write_text("4242\n")
    os.chown(pid_file, OTHER_UID, -1)
    assert sidecar_pid(runtime_dir) is None


def test_no_sidecar_is_started_where_the_directory_is_missing_or_shared(tmp_path: Path, shared_dir: Path) -> None:
    assert ensure_sidecar(tmp_path / "missing") is False
    assert ensure_sidecar(shared_dir) is False
    assert list(shared_dir.iterdir()) == []  # not even its log: an engine makes nothing there but its ring


@needs_root
def test_no_sidecar_is_started_in_another_users_directory(foreign_dir: Path) -> None:
    assert ensure_sidecar(foreign_dir) is False
    assert list(foreign_dir.iterdir()) == []


def test_no_second_sidecar_is_started_while_one_holds_the_lock(runtime_dir: Path) -> None:
    held = Held(runtime_dir / LOCK_NAME)
    try:
        assert ensure_sidecar(runtime_dir) is False
    finally:
        held.release()
    assert sorted(p.name for p in runtime_dir.iterdir()) == [LOCK_NAME]  # no log opened


def _children_in(state: str) -> list[int]:
    """This process's children whose /proc state is ``state`` (``Z``: exited, never reaped)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == state and int(fields[1]) == os.getpid():
            found.append(int(entry))
    return found


@pytest.fixture
def started(runtime_dir: Path, db_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The sidecar :func:`ensure_sidecar` started, by its pid (stopped afterwards)."""
    for name, value in memwatch_env(runtime_dir, db_path, MEMWATCH="1").items():
        monkeypatch.setenv(name, value)
    assert ensure_sidecar(runtime_dir) is True
    pid_file = runtime_dir / PID_NAME
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text().split()[0], what="the sidecar's pid"))
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not sidecar_running(runtime_dir), what="the sidecar to stop")


def test_the_started_sidecar_is_detached_and_logs_to_its_file(runtime_dir: Path, started: int) -> None:
    pid = started
    assert sidecar_running(runtime_dir) and sidecar_pid(runtime_dir) == pid
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    assert cmdline == [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(runtime_dir),
                       "--exit-when-idle", str(IDLE_EXIT_SECONDS), "--quiet-if-running"]
    assert IDLE_EXIT_SECONDS == 60
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"MEMWATCH=0" in environ and b"MEMWATCH=1" not in environ  # the sidecar never watches itself
    # Its own session, and not the engine's child: a teardown of the engine's process tree never reaches it.
    assert os.getsid(pid) == pid != os.getsid(0)
    assert pid not in _children_in("S") + _children_in("R")
    log = runtime_dir / LOG_NAME
    assert (log.stat().st_mode & 0o777) == 0o600
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{pid}/fd/1") == os.readlink(f"/proc/{pid}/fd/2") == str(log)
    # The launcher exited at once and was reaped: no zombie is left in the engine's process table.
    wait_for(lambda: not _children_in("Z"), timeout=10, what="the launcher to be reaped")


def test_a_log_that_cannot_be_opened_sends_the_output_nowhere(runtime_dir: Path, db_path: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere.log"
    elsewhere.write_text("")
    (runtime_dir / LOG_NAME).symlink_to(elsewhere)  # never followed
    for name, value in memwatch_env(runtime_dir, db_path).items():
        monkeypatch.setenv(name, value)
    assert ensure_sidecar(runtime_dir) is True
    pid_file = runtime_dir / PID_NAME
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text().split()[0], what="the sidecar's pid"))
    try:
        assert os.readlink(f"/proc/{pid}/fd/1") == os.readlink(f"/proc/{pid}/fd/2") == "/dev/null"
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not sidecar_running(runtime_dir), what="the sidecar to stop")
    assert elsewhere.read_text() == ""


def _stop(runtime_dir: Path) -> None:
    pid_file = runtime_dir / PID_NAME
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text().split()[0], what="the sidecar's pid"))
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not sidecar_running(runtime_dir), what="the sidecar to stop")


def test_the_launcher_inherits_nothing_of_the_engine_and_is_waited_for(
        runtime_dir: Path, db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD_LAUNCHER)
    hold = tmp_path / "go"
    for name, value in memwatch_env(runtime_dir, db_path, PYTHONPATH=str(site), MEMWATCH_TEST_HOLD=str(hold)).items():
        monkeypatch.setenv(name, value)
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)  # a descriptor of the engine's that a child would keep without close_fds
    try:
        assert ensure_sidecar(runtime_dir) is True
        launcher = int(wait_for(lambda: Path(f"{hold}.pid").exists() and Path(f"{hold}.pid").read_text(),
                                what="the launcher to start"))
        fds = {os.readlink(f"/proc/{launcher}/fd/{fd}") for fd in os.listdir(f"/proc/{launcher}/fd")}
        assert f"pipe:[{os.fstat(write_end).st_ino}]" not in fds
        assert os.getsid(launcher) == launcher != os.getsid(0)  # in a session of its own from its start
        reapers = [t for t in threading.enumerate() if t.name == "memwatch-sidecar-reaper"]
        assert len(reapers) == 1 and reapers[0].daemon  # an engine exiting never waits for it
        hold.write_text("")
        reapers[0].join(20)
        assert not reapers[0].is_alive() and not _children_in("Z")
    finally:
        hold.write_text("")
        os.close(read_end)
        os.close(write_end)
        _stop(runtime_dir)


def test_the_sidecar_never_reads_the_engines_stdin(runtime_dir: Path, db_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in memwatch_env(runtime_dir, db_path).items():
        monkeypatch.setenv(name, value)
    saved = os.dup(0)
    read_end, write_end = os.pipe()
    os.dup2(read_end, 0)  # an engine whose stdin is a pipe (a shell's, a supervisor's)
    try:
        assert ensure_sidecar(runtime_dir) is True
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read_end, write_end):
            os.close(fd)
    pid_file = runtime_dir / PID_NAME
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text().split()[0], what="the sidecar's pid"))
    try:
        assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    finally:
        _stop(runtime_dir)


def test_an_engine_with_its_stdin_closed_still_logs_and_keeps_no_descriptor(
        runtime_dir: Path, db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in memwatch_env(runtime_dir, db_path).items():
        monkeypatch.setenv(name, value)
    saved = os.dup(0)
    os.close(0)  # the lowest free descriptor: the directory's, opened first, takes it
    try:
        assert ensure_sidecar(runtime_dir) is True
        left_open = os.path.exists("/proc/self/fd/0")
    finally:
        os.dup2(saved, 0)
        os.close(saved)
    pid_file = runtime_dir / PID_NAME
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text().split()[0], what="the sidecar's pid"))
    try:
        assert not left_open
        assert os.readlink(f"/proc/{pid}/fd/1") == str(runtime_dir / LOG_NAME)
    finally:
        _stop(runtime_dir)


def test_a_fifo_as_the_log_never_blocks_the_engine(runtime_dir: Path, db_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkfifo(runtime_dir / LOG_NAME, 0o600)  # nobody reads it: a blocking open for writing would wait forever
    for name, value in memwatch_env(runtime_dir, db_path).items():
        monkeypatch.setenv(name, value)
    result: list[bool] = []
    caller = threading.Thread(target=lambda: result.append(ensure_sidecar(runtime_dir)), daemon=True)
    caller.start()
    caller.join(20)
    if caller.is_alive():  # let the blocked open go, so the test ends
        os.close(os.open(runtime_dir / LOG_NAME, os.O_RDONLY | os.O_NONBLOCK))
    try:
        assert result == [True]
        pid_file = runtime_dir / PID_NAME
        pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text().split()[0], what="the sidecar's pid"))
        assert os.readlink(f"/proc/{pid}/fd/1") == "/dev/null"
    finally:
        _stop(runtime_dir)
    assert stat.S_ISFIFO((runtime_dir / LOG_NAME).lstat().st_mode)


_WATCHED: list[Path] = []
_SEEN: list[tuple[bool, int]] = []


def _at_popen(event: str, args: tuple) -> None:
    """Whenever the engine starts a process while a test watches a log: how that log is open in the engine."""
    if event != "subprocess.Popen" or not _WATCHED:
        return
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(_WATCHED[0]):
                _SEEN.append((bool(fcntl.fcntl(int(fd), fcntl.F_GETFD) & fcntl.FD_CLOEXEC),
                              fcntl.fcntl(int(fd), fcntl.F_GETFL)))
        except OSError:
            continue


sys.addaudithook(_at_popen)  # an audit hook cannot be removed: it does nothing unless a test watches


def test_the_log_is_never_passed_to_a_process_another_thread_starts(
        runtime_dir: Path, db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in memwatch_env(runtime_dir, db_path).items():
        monkeypatch.setenv(name, value)
    _WATCHED[:] = [runtime_dir / LOG_NAME]
    try:
        assert ensure_sidecar(runtime_dir) is True
    finally:
        _WATCHED.clear()
    try:
        # Open while the launcher starts: close-on-exec (a fork and exec elsewhere in the engine keeps nothing of
        # it), appending, and non-blocking.
        assert len(_SEEN) == 1
        cloexec, flags = _SEEN[0]
        assert cloexec and flags & os.O_APPEND and flags & os.O_NONBLOCK and flags & os.O_ACCMODE == os.O_WRONLY
    finally:
        _SEEN.clear()
        _stop(runtime_dir)
