"""How a served vLLM's run ends, in its real process tree: vLLM's own teardown, a killed engine core.

vLLM's front end ends its engine core and workers with SIGKILL (``kill_process_tree``) even on Ctrl-C, and
SIGKILLs every process below them, which once included the sidecar the plugin started. The first two tests
drive those two mechanisms with real processes and a real ``memwatch serve`` but no vLLM (seconds); the
rest serve vLLM's CPU build with memwatch on and no sidecar beforehand (the plugin starts one), then kill
the engine core as the OOM killer would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from vllm_cpu import Server, descendants, load, prompts, require_engine, write_model

from memwatch_engine.adapters.vllm.teardown import close_rings_of, ending_pids, patch_teardown
from memwatch_engine.ring_reader import RingReader
from memwatch_engine.spawn import sidecar_pid

from processes import SidecarProcess, memwatch_env, query, wait_for

pytestmark = pytest.mark.timeout(900)  # the module's first test waits for vLLM to start: minutes on two busy cores

WRITER = """
import sys, time
from memwatch_engine import Monitor
from memwatch_engine.probes.cpu import CpuProbe
monitor = Monitor(engine="vllm", rank=int(sys.argv[1]), world_size=1, run_id="teardown", probe=CpuProbe(),
                  spawn_sidecar=False)
with monitor.phase("serve"):
    for _ in range(50):
        monitor.step("decode", num_seqs=1, num_tokens=1)
    print("ready", flush=True)
    time.sleep(120)
"""


def test_rings_marked_by_the_front_end_before_its_sigkill_end_ok_and_the_others_crashed(
        runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path):
        env = memwatch_env(runtime_dir, db_path, MEMWATCH="1")
        writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(rank)], env=env, stdout=subprocess.PIPE,
                                    text=True) for rank in (0, 1)]
        try:
            assert [writer.stdout.readline().strip() for writer in writers] == ["ready", "ready"]
            wait_for(lambda: query(db_path, "SELECT rank, status FROM ranks ORDER BY rank") == [
                (0, "running"), (1, "running")], 20, "both ranks stored")
            # What vLLM's front end does on Ctrl-C, for writer 0 only: mark, then SIGKILL.
            assert close_rings_of({writers[0].pid}, "teardown", runtime_dir) == ["teardown-r0.ring"]
            assert close_rings_of({writers[0].pid}, "another-run", runtime_dir) == []
            time.sleep(1)  # still writing, marked: the sidecar does not take the mark for an end yet
            assert query(db_path, "SELECT rank, status FROM ranks ORDER BY rank") == [(0, "running"), (1, "running")]
        finally:
            for writer in writers:
                writer.kill()
                writer.wait(timeout=30)
                writer.stdout.close()
        ended = wait_for(lambda: (rows := query(db_path, "SELECT rank, status FROM ranks ORDER BY rank"))
                         and "running" not in {status for _, status in rows} and rows, 20, "both ranks' ends")
        # an ended ring is removed once its end is committed: a moment after the status can be read
        wait_for(lambda: not list(runtime_dir.glob("teardown-*.ring")), 10, "the ended rings removed")
    assert ended == [(0, "ok"), (1, "crashed")]


CORE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])  # its worker, writing rank argv[2]
time.sleep(120)
"""


class _Proc:
    """What vLLM's ``shutdown`` is handed: ``multiprocessing`` processes (``pid``, ``is_alive()``)."""

    def __init__(self, popen: subprocess.Popen[str]) -> None:
        self.popen, self.pid = popen, popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None


def test_vllms_shutdown_wrapped_marks_the_rings_below_the_engine_processes_alive_when_it_begins(
        runtime_dir: Path, db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engine cores, each with a worker writing a ring below it; one core dies before the shutdown."""
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.setenv("MEMWATCH_RUN_ID", "teardown")
    seen: list[list[str]] = []

    def shutdown(procs: list[_Proc], timeout: float | None = None) -> None:
        """vLLM's, in short: what it is handed and everything below dies (kill_process_tree)."""
        seen.append(sorted(ring.name for ring in runtime_dir.glob("*.ring") if RingReader(ring).closed))
        for proc in procs:
            for pid in [*descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.popen.wait(timeout=30)

    utils = ModuleType("vllm.v1.engine.utils")
    utils.shutdown = shutdown
    patch_teardown(utils)
    with SidecarProcess(runtime_dir, db_path):
        env = memwatch_env(runtime_dir, db_path, MEMWATCH="1")
        workers: dict[int, list[int]] = {}
        cores = [subprocess.Popen([sys.executable, "-c", CORE, WRITER, str(rank)], env=env, stdout=subprocess.PIPE,
                                  text=True) for rank in (0, 1)]
        try:
            assert [core.stdout.readline().strip() for core in cores] == ["ready", "ready"]
            workers.update({rank: descendants(core.pid) for rank, core in enumerate(cores)})
            assert all(len(below) == 1 for below in workers.values())
            assert ending_pids([_Proc(core) for core in cores]) == {core.pid for core in cores} | {
                pid for below in workers.values() for pid in below}
            wait_for(lambda: query(db_path, "SELECT count(*) FROM ranks") == [(2,)], 20, "both ranks stored")
            os.kill(cores[1].pid, signal.SIGKILL)  # engine core 1 dies first: its worker is not vLLM's to end
            cores[1].wait(timeout=30)
            utils.shutdown([_Proc(core) for core in cores])
        finally:
            for core in cores:
                core.kill()
                core.wait(timeout=30)
                core.stdout.close()
            for pid in (pid for below in workers.values() for pid in below):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        ended = wait_for(lambda: (rows := query(db_path, "SELECT rank, status FROM ranks ORDER BY rank"))
                         and "running" not in {status for _, status in rows} and rows, 20, "both ranks' ends")
    assert seen == [["teardown-r0.ring"]]
    assert ended == [(0, "ok"), (1, "crashed")]


def test_the_sidecar_an_engine_starts_is_not_among_its_descendants(runtime_dir: Path, db_path: Path) -> None:
    """vLLM's ``kill_process_tree`` SIGKILLs ``psutil.Process(pid).children(recursive=True)``: never the sidecar."""
    script = ("import sys, time; from pathlib import Path; from memwatch_engine.spawn import ensure_sidecar; "
              "print(ensure_sidecar(Path(sys.argv[1])), flush=True); time.sleep(60)")
    engine = subprocess.Popen([sys.executable, "-c", script, str(runtime_dir)], text=True, stdout=subprocess.PIPE,
                              env={**os.environ, "MEMWATCH_DB": str(db_path), "MEMWATCH_RUNTIME_DIR": str(runtime_dir)})
    try:
        assert engine.stdout.readline().strip() == "True"
        pid = wait_for(lambda: sidecar_pid(runtime_dir), 30, "the sidecar's pid file")
        assert pid not in descendants(engine.pid)
        engine.kill()  # as vLLM kills an engine core, and everything below it
        engine.wait(timeout=30)
        time.sleep(0.5)
        os.kill(pid, 0)  # the sidecar lives on
    finally:
        engine.kill()
        engine.wait(timeout=30)
        engine.stdout.close()
        pid = sidecar_pid(runtime_dir)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)


@dataclass
class Served:
    server: Server
    runtime: Path
    db: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    require_engine()
    folder = tmp_path_factory.mktemp("vllm-cpu-lifecycle")
    runtime = folder / "run"
    runtime.mkdir(mode=0o700)
    db = folder / "memwatch.db"
    server = Server(write_model(folder / "qwen2-tiny"), folder / "server.log",
                    {"MEMWATCH": "1", "MEMWATCH_RUNTIME_DIR": str(runtime), "MEMWATCH_DB": str(db),
                     "MEMWATCH_SPAWN": "1"},
                    ("--kv-cache-memory-bytes", str(64 << 20)))
    try:
        server.start()
        print(f"vllm serve answered after {server.startup_s:.1f} s")
        yield Served(server, runtime, db)
    finally:
        server.stop(signal.SIGKILL, timeout=30)
        pid = sidecar_pid(runtime)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def test_the_plugin_started_a_sidecar_outside_vllms_process_tree(served: Served) -> None:
    pid = wait_for(lambda: sidecar_pid(served.runtime), 30, "the sidecar the plugin started")
    os.kill(pid, 0)
    assert pid not in descendants(served.server.proc.pid)


def test_kill_9_of_the_engine_core_is_a_crash_within_5_s_and_no_run_stays_running(served: Served) -> None:
    done = load(served.server.url, prompts(4, 64), 32, clients=4, stream=True)
    assert [c.output_tokens for c in done] == [32] * 4
    wait_for(lambda: query(served.db, "SELECT count(*) FROM ranks WHERE status = 'running'") == [(2,)], 30,
             "both ranks stored")
    sidecar = sidecar_pid(served.runtime)
    core = served.server.pids()["EngineCore"]
    os.kill(core, signal.SIGKILL)
    killed = time.monotonic()
    # The engine core's rank (its scheduler, rank 1) is crashed within 5 s (the sidecar looks at a writer every
    # second), given the CPU to look: on a machine loaded past its cores the bound is 15 s. The run is crashed
    # once vLLM's worker is gone too.
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    try:
        wait_for(lambda: query(served.db, "SELECT status FROM ranks WHERE rank = 1") == [("crashed",)],
                 15 if busy else 5, "the engine core's rank marked crashed")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: ranks {query(served.db, 'SELECT rank, status FROM ranks')}") from None
    rank_s = time.monotonic() - killed
    wait_for(lambda: query(served.db, "SELECT status FROM runs") == [("crashed",)], 30, "the run marked crashed")
    print(f"kill -9 of the engine core: its rank crashed after {rank_s:.1f} s, the run after "
          f"{time.monotonic() - killed:.1f} s")
    # vLLM's front end sees its engine dead and ends the worker: nothing of the run is left running, no ring stays.
    try:
        served.server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        served.server.stop(signal.SIGTERM)
    wait_for(lambda: query(served.db, "SELECT count(*) FROM ranks WHERE status = 'running'") == [(0,)], 30,
             "no rank running")
    # The engine core's scheduler crashed; its worker, seeing its parent gone, shut itself down (its own ``shutdown``).
    assert query(served.db, "SELECT rank, status FROM ranks ORDER BY rank") == [(0, "ok"), (1, "crashed")]
    assert query(served.db, "SELECT status FROM runs") == [("crashed",)]
    assert wait_for(lambda: not list(served.runtime.glob("*.ring")), 30, "the rings removed")
    os.kill(sidecar, 0)  # the sidecar outlived the engine and vLLM's teardown


def _sleep() -> None:
    time.sleep(60)


def test_an_engine_process_already_exiting_is_not_vllms_to_end() -> None:
    """vLLM's liveness monitor calls ``shutdown`` once an engine's sentinel closes, which can be before the killed
    process is reaped: ``is_alive()`` may still say True. Its readable sentinel says it is exiting."""
    import multiprocessing
    import multiprocessing.connection

    engine = multiprocessing.get_context("spawn").Process(target=_sleep)
    engine.start()
    try:
        assert ending_pids([engine]) == {engine.pid}
        os.kill(engine.pid, signal.SIGKILL)
        wait_for(lambda: multiprocessing.connection.wait([engine.sentinel], timeout=0), 10, "the sentinel closed")
        unreaped = type("Unreaped", (), {"pid": engine.pid, "sentinel": engine.sentinel, "is_alive": lambda self: True})
        assert ending_pids([unreaped()]) == set()
    finally:
        engine.kill()
        engine.join(timeout=30)
