"""memwatch.attach.hostinfo against real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from memwatch.attach.hostinfo import MIN_CPU_WINDOW_S, HostWatcher, ProcessExited
from memwatch.errors import NotFoundError, PermissionDeniedError

NO_SUCH_PID = 4_194_305
"""Above Linux's PID_MAX_LIMIT (2**22), so no process can ever have it."""


def _wait_for_children(pid: int, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(psutil.Process(pid).children(recursive=True)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not start {count} children")
        time.sleep(0.01)


def test_sample_describes_the_process(sleeper: subprocess.Popen[bytes]) -> None:
    sample = HostWatcher(sleeper.pid).sample()
    process = psutil.Process(sleeper.pid)
    assert (sample.pid, sample.name, sample.cmdline) == (sleeper.pid, "sleep", ("sleep", "30"))
    assert sample.user == process.username()
    assert sample.rss_bytes == process.memory_info().rss
    assert sample.status == psutil.STATUS_SLEEPING
    assert sample.create_time_ns == int(process.create_time() * 1e9)
    assert sample.children == ()
    assert sample.cpu_percent == 0.0  # asleep since it started


def test_children_are_collected_recursively() -> None:
    # sh -> (sh -> sleep): the inner shell runs two commands, so it stays as a middle process.
    tree = subprocess.Popen(["sh", "-c", 'sh -c "sleep 30; true" & wait'])
    try:
        _wait_for_children(tree.pid, 2)
        sample = HostWatcher(tree.pid).sample()
        assert sorted(psutil.Process(pid).name() for pid in sample.children) == ["sh", "sleep"]
    finally:
        for child in psutil.Process(tree.pid).children(recursive=True):
            child.kill()
        tree.kill()
        tree.wait()


def test_cpu_percent_covers_the_time_since_the_previous_sample() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        watcher = HostWatcher(spinner.pid)
        time.sleep(0.5)
        busy = watcher.sample().cpu_percent
        assert busy is not None and busy > 10.0  # a busy loop: most of one CPU, even on a loaded machine
    finally:
        spinner.kill()
        spinner.wait()


def test_the_first_cpu_reading_waits_for_a_measurable_window(sleeper: subprocess.Popen[bytes]) -> None:
    opened = time.monotonic()
    HostWatcher(sleeper.pid).sample()
    assert time.monotonic() - opened >= MIN_CPU_WINDOW_S


def test_no_such_pid_is_not_found() -> None:
    with pytest.raises(NotFoundError) as caught:
        HostWatcher(NO_SUCH_PID)
    assert str(caught.value) == f"no process with pid {NO_SUCH_PID}; check the pid with `ps -p {NO_SUCH_PID}`"
    assert caught.value.exit_code == 3


def test_another_users_process_is_permission_denied(sleeper: subprocess.Popen[bytes]) -> None:
    not_the_owner = os.geteuid() + 1  # never 0, never the owner's uid
    owner = psutil.Process(sleeper.pid).username()
    with pytest.raises(PermissionDeniedError) as caught:
        HostWatcher(sleeper.pid, euid=not_the_owner)
    assert str(caught.value) == (
        f"process {sleeper.pid} belongs to user {owner}; run memwatch as that user or as root"
    )
    assert caught.value.exit_code == 5


def test_root_may_watch_anyone(sleeper: subprocess.Popen[bytes]) -> None:
    assert HostWatcher(sleeper.pid, euid=0).sample().pid == sleeper.pid


def test_an_exited_process_ends_sampling(sleeper: subprocess.Popen[bytes]) -> None:
    watcher = HostWatcher(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    with pytest.raises(ProcessExited) as caught:
        watcher.sample()
    assert (caught.value.pid, str(caught.value)) == (sleeper.pid, f"process {sleeper.pid} exited")


def test_a_zombie_counts_as_exited(sleeper: subprocess.Popen[bytes]) -> None:
    watcher = HostWatcher(sleeper.pid)
    sleeper.kill()
    deadline = time.monotonic() + 5
    while psutil.Process(sleeper.pid).status() != psutil.STATUS_ZOMBIE:  # killed, not yet reaped
        assert time.monotonic() < deadline, "the killed process never became a zombie"
        time.sleep(0.01)
    with pytest.raises(ProcessExited):
        watcher.sample()
    with pytest.raises(NotFoundError):
        HostWatcher(sleeper.pid)
