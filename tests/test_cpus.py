"""When a second process may take a CPU: affinity, the container's quota, and the host's load."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from memwatch.store import cpus

V2 = "0::/kubepods/pod1/c1\n"
V2_LIMIT = "/sys/fs/cgroup/kubepods/pod1/c1/cpu.max"


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):
    """A host of ``online`` CPUs, with the files /proc and /sys would show."""
    files: dict[str, str] = {}

    def make(online: int = 2, affinity: int | None = None, load: float = 0.1, running: int = 1,
             **extra: str) -> dict[str, str]:
        files.clear()
        files["/proc/loadavg"] = f"{load:.2f} 0.05 0.01 {running}/412 5120\n"
        files.update(extra)
        monkeypatch.setattr(os, "cpu_count", lambda: online)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity or online)))
        monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.05, 0.01))
        return files

    monkeypatch.setattr(cpus, "_read", lambda path: files.get(path))
    return make


def test_an_idle_two_cpu_host_has_one_to_spare(host) -> None:
    host(online=2, load=0.1, running=1)  # only this process runs
    assert cpus.cpu_to_spare()


@pytest.mark.parametrize(("load", "running"), [(0.1, 2), (1.4, 3)])
def test_one_other_busy_task_on_two_cpus_leaves_none(host, load: float, running: int) -> None:
    host(online=2, load=load, running=running)
    assert not cpus.cpu_to_spare()


def test_what_ran_in_the_last_minute_does_not_count_only_what_runs_now(host) -> None:
    host(online=2, load=1.9, running=1)  # the user's previous commands kept a CPU busy; now it is idle
    assert cpus.cpu_to_spare()


def test_a_large_host_at_half_load_has_cpus_to_spare(host) -> None:
    host(online=16, load=8.0, running=9)
    assert cpus.cpu_to_spare()


def test_a_process_pinned_to_one_cpu_never_splits(host) -> None:
    host(online=16, affinity=1, load=0.0, running=1)
    assert not cpus.cpu_to_spare()


@pytest.mark.parametrize(("cpu_max", "spare"), [("max 100000\n", True), ("200000 100000\n", True),
                                                ("150000 100000\n", False), ("100000 100000\n", False),
                                                ("garbage\n", True)])
def test_the_container_quota_of_cgroup_v2_counts(host, cpu_max: str, spare: bool) -> None:
    files = host(online=16, load=0.5, running=1)
    files["/proc/self/cgroup"], files[V2_LIMIT] = V2, cpu_max
    assert cpus.cpu_to_spare() is spare


@pytest.mark.parametrize(("quota", "spare"), [("-1", True), ("400000", True), ("50000", False)])
def test_the_container_quota_of_cgroup_v1_counts(host, quota: str, spare: bool) -> None:
    files = host(online=16, load=0.5, running=1)
    files["/proc/self/cgroup"] = "4:cpu,cpuacct:/docker/abc\n"
    files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"], files["/sys/fs/cgroup/cpu/cpu.cfs_period_us"] = quota, "100000"
    assert cpus.cpu_to_spare() is spare


def test_an_unreadable_proc_falls_back_to_the_load_average(host) -> None:
    files = host(online=2, load=0.1)
    del files["/proc/loadavg"]
    assert cpus.cpu_to_spare()
    files["/proc/loadavg"] = "not a load line"
    assert cpus.cpu_to_spare()
    host(online=2, load=1.2)
    files["/proc/loadavg"] = "not a load line"
    assert not cpus.cpu_to_spare()


def test_an_oversized_file_is_not_read(tmp_path) -> None:
    big = tmp_path / "loadavg"
    big.write_text("1 " * 5000)
    assert cpus._read(str(big)) is None and cpus._read(str(tmp_path / "absent")) is None


@pytest.mark.timeout(60)
def test_busy_loops_on_every_cpu_of_this_machine_leave_none_to_spare() -> None:
    """The real /proc: as many spinning processes as CPUs are seen at once, whatever the minute's average."""
    count = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.3)  # every spinner past its start-up, running
        seen = [cpus.cpu_to_spare() for _ in range(5)]
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait(timeout=10)
    assert not any(seen)
