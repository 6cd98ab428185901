"""`memwatch attach` end to end: real `memwatch` processes, the fake NVML library, real target processes."""

from __future__ import annotations

import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fake_nvml import GIB, FakeNvmlScript, fake_nvml_env, no_driver_env

pytest_plugins = ["fake_nvml"]

NO_SUCH_PID = 4_194_305  # above PID_MAX_LIMIT (2**22): no process can have it

Machine = tuple[FakeNvmlScript, dict[str, str]]
"""A scenario and the environment in which `memwatch` plays it."""
Sleeper = subprocess.Popen[bytes]

# The `memwatch` group with `attach` on it. As root, the "another user's process" case drops to the
# `nobody` user after imports (so its interpreter need not be readable by nobody).
RUNNER = """
import os, sys
from memwatch.cli import main
from memwatch.cli.attach import attach
main.add_command(attach)
if os.environ.get("DROP_TO_NOBODY"):
    os.setgid(65534)
    os.setuid(65534)
main(sys.argv[1:], prog_name="memwatch")
"""


def memwatch(*args: str, env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUNNER, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def memwatch_background(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture
def machine(fake_nvml_library: Path, tmp_path: Path) -> Machine:
    """An 80 GiB GPU with 12 GiB used, as a scenario and the environment that plays it."""
    script = FakeNvmlScript(tmp_path / "scenario.txt")
    script.add_gpu("NVIDIA H100 80GB HBM3", total_bytes=80 * GIB, used_bytes=12 * GIB, uuid="GPU-0")
    script.write()
    return script, fake_nvml_env(fake_nvml_library, script.path)


def test_once_json_reports_gpu_bytes_and_host_info(
    machine: Machine, sleeper: Sleeper
) -> None:
    script, env = machine
    script.gpus[0].processes = {sleeper.pid: 10 * GIB, 1: 2 * GIB}
    script.write()
    before = time.time_ns()
    result = memwatch("attach", str(sleeper.pid), "--once", "--json", env=env)
    after = time.time_ns()
    assert (result.returncode, result.stderr) == (0, "")
    (line,) = result.stdout.splitlines()
    sample = json.loads(line)
    assert before <= sample.pop("ts_ns") <= after
    host = psutil.Process(sleeper.pid)
    assert sample == {
        "pid": sleeper.pid,
        "source": "nvml",
        "host": {
            "pid": sleeper.pid, "name": "sleep", "cmdline": ["sleep", "30"], "user": host.username(),
            "rss_bytes": host.memory_info().rss, "cpu_percent": 0.0, "status": "sleeping",
            "create_time_ns": int(host.create_time() * 1e9), "children": [],
        },
        "gpus": [{
            "index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0",
            # 80 GiB total, 12 GiB used, 80 - 12 = 68 GiB free; the sleeper holds 10 GiB of the 12
            "total_bytes": 85_899_345_920, "used_bytes": 12_884_901_888, "free_bytes": 73_014_444_032,
            "process_used_bytes": 10_737_418_240,
            "processes": [{"pid": sleeper.pid, "used_bytes": 10_737_418_240}],
            "error": None,
        }],
        "ranks": [],
    }


def test_samples_follow_the_gpu_until_the_process_exits(
    machine: Machine, sleeper: Sleeper
) -> None:
    script, env = machine
    script.gpus[0].processes = {sleeper.pid: 1 * GIB}
    script.write()
    attach = memwatch_background("attach", str(sleeper.pid), "--json", "--interval", "0.05", env=env)
    assert attach.stdout is not None
    assert json.loads(attach.stdout.readline())["gpus"][0]["process_used_bytes"] == 1 * GIB
    script.gpus[0].processes = {sleeper.pid: 3 * GIB}
    script.write()
    while json.loads(attach.stdout.readline())["gpus"][0]["process_used_bytes"] != 3 * GIB:
        pass  # samples taken before the change was written
    sleeper.kill()
    sleeper.wait()
    _, stderr = attach.communicate(timeout=10)
    assert attach.returncode == 0
    assert stderr == (
        f"process {sleeper.pid} exited; its exit code is unknown (only its parent process can collect it)\n"
    )


def test_duration_bounds_the_samples(
    machine: Machine, sleeper: Sleeper
) -> None:
    script, env = machine
    script.gpus[0].processes = {sleeper.pid: 1 * GIB}
    script.write()
    result = memwatch("attach", str(sleeper.pid), "--json", "--interval", "0.1", "--duration", "0.2", env=env)
    assert result.returncode == 0
    stamps = [json.loads(line)["ts_ns"] for line in result.stdout.splitlines()]
    assert len(stamps) == 3  # at 0, 0.1 and 0.2 s
    assert stamps == sorted(stamps)


def test_ctrl_c_stops_cleanly(machine: Machine, sleeper: Sleeper) -> None:
    script, env = machine
    script.gpus[0].processes = {sleeper.pid: 1 * GIB}
    script.write()
    # A terminal's Ctrl-C reaches a process whose SIGINT is at its default. A test run started in the
    # background (`pytest &` from a script) inherits SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler, so the child would ignore the signal and run on: restore the default.
    attach = subprocess.Popen(
        [sys.executable, "-c", RUNNER, "attach", str(sleeper.pid), "--json", "--interval", "0.05"], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert attach.stdout is not None
    ready, _, _ = select.select([attach.stdout], [], [], 30)
    assert ready, "no sample within 30 s"
    json.loads(attach.stdout.readline())
    attach.send_signal(signal.SIGINT)
    stdout, stderr = attach.communicate(timeout=30)
    assert (attach.returncode, stderr) == (0, "")
    for line in stdout.splitlines():
        assert json.loads(line)["pid"] == sleeper.pid  # every line printed is whole


def test_the_live_view_prints_the_gpu_table(
    machine: Machine, sleeper: Sleeper
) -> None:
    script, env = machine
    script.gpus[0].processes = {sleeper.pid: 10 * GIB}
    script.write()
    result = memwatch("attach", str(sleeper.pid), "--once", env={**env, "COLUMNS": "80"})
    assert result.returncode == 0
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    assert lines[0] == f"pid {sleeper.pid} · sleep 30"
    assert "   0   NVIDIA H100 80GB HB…   10.0 GiB   12.0 GiB   68.0 GiB   80.0 GiB   ▁" in lines


def test_record_stores_an_nvml_run_that_timeline_reads(
    machine: Machine, sleeper: Sleeper, tmp_path: Path
) -> None:
    script, env = machine
    script.gpus[0].processes = {sleeper.pid: 10 * GIB}
    script.write()
    db = tmp_path / "runs.db"
    result = memwatch("attach", str(sleeper.pid), "--once", "--json", "--record", "--db", str(db), env=env)
    assert result.returncode == 0
    with sqlite3.connect(db) as conn:
        (run_id, pid, source, status), = conn.execute("SELECT run_id, pid, source, status FROM runs").fetchall()
        assert (pid, source, status) == (sleeper.pid, "nvml", "detached")
        assert conn.execute("SELECT rank, process_used_bytes FROM samples").fetchall() == [(0, 10 * GIB)]
    conn.close()
    assert result.stderr == f"recorded run {run_id}\n"

    timeline = memwatch("timeline", run_id, "--db", str(db), "--json", env=env)
    assert timeline.returncode == 0, timeline.stderr
    (row,) = [json.loads(line) for line in timeline.stdout.splitlines()]
    assert (row["rank"], row["driver_used_bytes"], row["allocated_bytes"]) == (0, 12 * GIB, None)


def _error(result: subprocess.CompletedProcess[str]) -> tuple[int, str]:
    return result.returncode, result.stderr


def test_no_such_pid(machine: Machine) -> None:
    _, env = machine
    assert _error(memwatch("attach", str(NO_SUCH_PID), "--once", env=env)) == (
        3, f"error: no process with pid {NO_SUCH_PID}; check the pid with `ps -p {NO_SUCH_PID}`\n"
    )


def test_a_process_not_on_any_gpu(machine: Machine, sleeper: Sleeper) -> None:
    _, env = machine
    assert _error(memwatch("attach", str(sleeper.pid), "--once", env=env)) == (
        3, f"error: process {sleeper.pid} is not using any GPU (NVML lists no memory for it); is it the right pid?\n"
    )


def test_no_nvml_driver(sleeper: Sleeper, tmp_path: Path) -> None:
    assert _error(memwatch("attach", str(sleeper.pid), "--once", env=no_driver_env(tmp_path / "nodriver"))) == (
        4, "error: NVML is not available: no NVIDIA driver on this machine (libnvidia-ml.so.1 could not be "
           "loaded); run on a host with the NVIDIA driver installed; process "
           f"{sleeper.pid} is not instrumented either (no memwatch ring), so there is nothing to read: start it "
           "with MEMWATCH=1\n",
    )


def test_host_pids_from_another_pid_namespace(
    machine: Machine, sleeper: Sleeper
) -> None:
    script, env = machine
    script.gpus[0].processes = {NO_SUCH_PID: 1 * GIB}
    script.write()
    code, message = _error(memwatch("attach", str(sleeper.pid), "--once", env=env))
    assert code == 4
    assert message.startswith(f"error: NVML lists GPU processes ({NO_SUCH_PID}) that do not exist here")
    assert message.endswith("attach from the host or start the container with --pid=host\n")


def test_another_users_process(machine: Machine, sleeper: Sleeper) -> None:
    _, env = machine
    if os.geteuid() == 0:
        target, env = sleeper.pid, {**env, "DROP_TO_NOBODY": "1"}  # root's sleep, watched as nobody
    else:
        target = 1  # init belongs to root
    owner = psutil.Process(target).username()
    assert _error(memwatch("attach", str(target), "--once", env=env)) == (
        5, f"error: process {target} belongs to user {owner}; run memwatch as that user or as root\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--interval", "0"],
         "error: invalid value for '--interval': '0' must be a finite number >0 and <=86400; see `memwatch attach "
         "--help`"),
        (["--db", "x.db"], "error: --db only says where --record stores samples; add --record or drop --db"),
    ],
)
def test_bad_options_are_usage_errors(
    machine: Machine, sleeper: Sleeper, args: list[str], message: str
) -> None:
    _, env = machine
    result = memwatch("attach", str(sleeper.pid), *args, env=env)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.splitlines()) == 1
