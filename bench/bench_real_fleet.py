"""The router's policies on real engines: vLLM's CPU build behind the ``sim --fleet`` policies, over HTTP.

Two (``--engines``) ``vllm serve`` of the tiny Qwen2 model the tests use (``.engines/vllm-cpu``, ``make engines``),
each with memwatch on and its own ``memwatch serve --prometheus`` sidecar, each with a KV cache small enough that
the trace's bursts preempt. A router loop replays a short bursty trace against them once per policy
(``round-robin``, ``kv-usage``, ``kv-usage-queue``, ``memwatch``: the objects of ``memwatch.sim.fleet.policies``),
on the same servers, waiting for every engine to be idle between policies. Whenever requests are due (an
arrival, or held requests offered again every 250 ms as in the simulated fleet) it scrapes every engine and asks
the policy for a target: ``kv-usage`` and ``kv-usage-queue`` read vLLM's own ``/metrics``
(``vllm:kv_cache_usage_perc``, ``vllm:num_requests_waiting``), ``memwatch`` reads the sidecar's headroom gauges.
Each request goes out as a streaming ``POST /v1/completions`` with a token-id prompt and every output token
generated (``ignore_eos``).

The trace is ``fleet_bursty_long_context`` scaled to the tiny model: its first ``--requests`` requests (drawn
with each of ``--seeds``), prompt and output lengths and the engines' KV cache times ``--token-scale`` (1/8: the trace's
16,384-token context on the model's 2,048), arrivals times ``--time-scale``. Per policy: requests completed of
those sent, vLLM's own preemption count (``vllm:num_preemptions_total``, its rise over the run), engines that
died (an OOM on a GPU; none expected on a CPU), output tokens/s (completed requests' tokens over the time
from the trace's start to the last completion), latency from arrival to the last token (p50, p99), time to
first token from arrival (p99: the simulator's "queue" is arrival to first scheduled step), and the time
requests waited at the router (p99).

Minutes (engine start-ups, then a few minutes per policy), so it is not in the smoke run of the benchmarks.

Run: .venv/bin/python bench/bench_real_fleet.py [--engines 2] [--requests 60] [--seeds 1 2 3]
[--time-scale 0.125] [--write docs/routing.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from doc_block import replace_block
from vllm_cpu import ENGINE, KV_BYTES_PER_TOKEN, Server, complete, free_port, write_model

from memwatch.sim.clock import NS_PER_S
from memwatch.sim.fleet import load_trace
from memwatch.sim.fleet.engine import FleetRequest
from memwatch.sim.fleet.fleet import SCRAPE_INTERVAL_NS, offered
from memwatch.sim.fleet.policies import (
    KV_TOTAL,
    KV_USED,
    POLICIES,
    READ,
    SAMPLES,
    VALID,
    WAITING,
    EngineView,
    make_policy,
)
from memwatch.sim.fleet.results import percentile
from memwatch.sim.fleet.scrape import Scrape, scrape

from processes import SidecarProcess

TRACE = "fleet_bursty_long_context"
BLOCK_SIZE = 128
"""The CPU attention backend's block size (vLLM resolves it; tests/test_vllm_cpu_serve.py checks it)."""
SIM_KV_TOKENS = 197 * 256
"""One simulated engine's KV cache on the trace: 197 blocks of 256 tokens (the trace's own comment)."""
MODEL_CONTEXT = 2048
"""``--max-model-len`` of tests/vllm_cpu.py's servers."""
VLLM_READ = frozenset({"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:iteration_tokens_total"})
IDLE_REJECT_S = 5.0
"""A request still held when nothing has been in flight for 5 s, with nothing left to arrive, is rejected: no
later scrape of an idle fleet can admit it (the simulated fleet rejects it at the first such scrape)."""
BEGIN, END = "<!-- real-fleet:begin -->", "<!-- real-fleet:end -->"


def scaled(requests: list[FleetRequest], count: int, token_scale: float, time_scale: float,
           context: int = MODEL_CONTEXT) -> list[FleetRequest]:
    """The first ``count`` requests with their prompt and output lengths times ``token_scale`` (at least 1 token
    each, the output cut so that prompt + output fits ``context``) and their arrivals times ``time_scale``."""
    out = []
    for request in requests[:count]:
        prompt = min(context - 1, max(1, round(request.prompt_tokens * token_scale)))
        output = min(context - prompt, max(1, round(request.output_tokens * token_scale)))
        out.append(dataclasses.replace(request, prompt_tokens=prompt, output_tokens=output, stop_tokens=None,
                                       arrival_ns=round(request.arrival_ns * time_scale)))
    return out


def token_ids(request: FleetRequest, salt: int) -> list[int]:
    """A prompt of the request's length, distinct from every other request's from its first token."""
    return [3 + (request.request_id * 1009 + salt * 7919 + position * 17) % 2000
            for position in range(request.prompt_tokens)]


def vllm_view(url: str, run_id: str) -> Scrape:
    """vLLM's own ``/metrics`` as the policies read a scrape: its KV-cache usage fraction as blocks used over a
    capacity of 1, its waiting queue, and its engine steps (the histogram of tokens per step counts one per
    step) as the sample count that tells the router which requests it sent the engine shows already."""
    page = scrape(url, VLLM_READ)
    labels = {"run_id": run_id}
    view = Scrape()
    for name, source in ((KV_USED, "vllm:kv_cache_usage_perc"), (WAITING, "vllm:num_requests_waiting"),
                         (SAMPLES, "vllm:iteration_tokens_total_count")):
        value = page.highest(source)
        if value is not None:
            view.samples[name].append((labels, value))
    view.samples[KV_TOTAL].append((labels, 1.0))
    return view


@dataclass
class Engine:
    index: int
    server: Server
    sidecar: SidecarProcess
    memwatch_url: str
    run_id: str = ""

    def counters(self) -> dict[str, float]:
        return self.server.metrics()


@dataclass
class Record:
    request: FleetRequest
    engine: int = -1
    sent_s: float | None = None
    ttft_s: float | None = None
    """From the send to the first token."""
    done_s: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def completed(self) -> bool:
        """It generated every output token it asked for."""
        return self.done_s is not None and self.tokens == self.request.output_tokens


@dataclass(frozen=True)
class Row:
    policy: str
    sent: int
    requests: int
    completed: int
    rejected: int
    preemptions: int
    died: int
    tokens_per_s: float
    p50_latency_s: float | None
    p99_latency_s: float | None
    p99_ttft_s: float | None
    p99_router_s: float | None
    wall_s: float


@dataclass
class Run:
    """One policy's replay of one draw of the trace."""

    records: list[Record]
    rejected: int
    preemptions: int
    died: int
    wall_s: float


def run_policy(name: str, engines: list[Engine], requests: list[FleetRequest], seed: int, salt: int) -> Run:
    """Replay ``requests`` through ``name`` in real time; every engine idle before and after."""
    policy = make_policy(name, random.Random(seed))
    views = {engine.index: EngineView(engine.index, engine.run_id) for engine in engines}
    before = [engine.counters()["vllm:num_preemptions_total"] for engine in engines]
    records = {request.request_id: Record(request) for request in requests}
    arrivals, held = deque(requests), deque[FleetRequest]()
    inflight: list[Future[None]] = []
    rejected, tick, idle_since = 0, 0, None
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        start = time.monotonic()
        while arrivals or held or inflight:
            now = time.monotonic() - start
            arrived = []
            while arrivals and arrivals[0].arrival_ns <= now * NS_PER_S:
                arrived.append(arrivals.popleft())
            due, held = offered(held, arrived, tick)
            alive = [engine for engine in engines if engine.server.proc.poll() is None]
            if due and alive:
                for engine in alive if name != "round-robin" else ():  # round-robin reads nothing
                    views[engine.index].rescraped(
                        scrape(engine.memwatch_url, READ) if name == "memwatch"
                        else vllm_view(f"{engine.server.url}/metrics", engine.run_id))
                for request in due:
                    choice = policy.choose(request, [views[engine.index] for engine in alive])
                    if choice is None:
                        held.append(request)
                        continue
                    views[choice].send(request)
                    record = records[request.request_id]
                    record.engine, record.sent_s = choice, time.monotonic() - start
                    inflight.append(pool.submit(_send, engines[choice], record, token_ids(request, salt), start))
            else:
                held.extend(due)
            inflight = [future for future in inflight if not future.done()]
            idle_since = None if inflight or arrivals else (idle_since if idle_since is not None else now)
            if held and idle_since is not None and now - idle_since >= IDLE_REJECT_S:
                rejected += len(held)
                held.clear()
            tick += 1
            time.sleep(max(0.0, start + tick * SCRAPE_INTERVAL_NS / NS_PER_S - time.monotonic()))
    wall = time.monotonic() - start
    wait_idle(engines)
    after = [engine.counters()["vllm:num_preemptions_total"] for engine in engines]
    return Run(list(records.values()), rejected, round(sum(after) - sum(before)),
               sum(engine.server.proc.poll() is not None for engine in engines), wall)


def _send(engine: Engine, record: Record, prompt: list[int], start: float) -> None:
    try:
        done = complete(engine.server.url, prompt, record.request.output_tokens, stream=True, timeout=900)
    except Exception as exc:  # an engine that died or refused: the request did not complete
        record.error = f"{type(exc).__name__}: {exc}"
        return
    record.done_s, record.ttft_s, record.tokens = time.monotonic() - start, done.ttft_s, done.output_tokens


def summarize(name: str, runs: list[Run]) -> Row:
    """One policy's row over its runs: counts summed, tokens/s averaged, the percentiles of every request of every
    run together."""
    records = [record for run in runs for record in run.records]
    done = [r for r in records if r.completed]

    def arrival(record: Record) -> float:
        return record.request.arrival_ns / NS_PER_S

    def p(values: list[float], q: float) -> float | None:
        found = percentile(values, q)
        return None if found is None else round(found, 3)

    rates = []
    for run in runs:
        finished = [r for r in run.records if r.completed]
        last = max((r.done_s for r in finished), default=0.0)
        rates.append(sum(r.tokens for r in finished) / last if last else 0.0)
    latency = [r.done_s - arrival(r) for r in done]
    return Row(name, sum(r.sent_s is not None for r in records), len(records), len(done),
               sum(run.rejected for run in runs), sum(run.preemptions for run in runs), max(run.died for run in runs),
               round(statistics.fmean(rates), 1), p(latency, 50), p(latency, 99),
               p([r.sent_s + r.ttft_s - arrival(r) for r in done], 99),
               p([r.sent_s - arrival(r) for r in records if r.sent_s is not None], 99),
               round(sum(run.wall_s for run in runs), 1))


def wait_idle(engines: list[Engine], timeout: float = 600.0) -> None:
    """Until every engine that is up holds no request and its KV cache is empty, as vLLM's gauges say."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [engine for engine in engines if engine.server.proc.poll() is None
                and _load(engine.counters()) > 0]
        if not busy:
            return
        time.sleep(0.5)
    raise AssertionError("the engines never went idle")


def _load(values: dict[str, float]) -> float:
    return (values["vllm:num_requests_running"] + values["vllm:num_requests_waiting"]
            + values["vllm:kv_cache_usage_perc"])


def start_engines(count: int, folder: Path, kv_tokens: int) -> list[Engine]:
    """``count`` servers, each with its sidecar; started one after another (two cores: at once is no faster)."""
    model = write_model(folder / "qwen2-tiny")
    blocks = kv_tokens // BLOCK_SIZE + 1  # the null block is never handed out
    engines = []
    for index in range(count):
        home = folder / f"engine{index}"
        runtime = home / "run"
        runtime.mkdir(parents=True, mode=0o700)
        port = free_port()
        sidecar = SidecarProcess(runtime, home / "memwatch.db", "--prometheus", f"127.0.0.1:{port}",
                                 "--poll-interval", "0.05")
        server = Server(model, home / "server.log",
                        {"MEMWATCH": "1", "MEMWATCH_RUNTIME_DIR": str(runtime),
                         "MEMWATCH_DB": str(home / "memwatch.db"),
                         # each engine's threads on a core of their own (by default every one takes core 0)
                         "VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1))},
                        ("--kv-cache-memory-bytes", str(blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN),
                         "--no-enable-prefix-caching"))
        engines.append(Engine(index, server, sidecar, f"http://127.0.0.1:{port}/metrics"))
        server.start()
        print(f"engine {index}: vllm serve answered after {server.startup_s:.0f} s ({blocks - 1} KV blocks of "
              f"{BLOCK_SIZE} tokens)", flush=True)
    for engine in engines:
        engine.run_id = _wait(lambda e=engine: _run_id(e.memwatch_url), 120, f"engine {engine.index}'s run")
    return engines


def _run_id(url: str) -> str | None:
    ids = {labels["run_id"] for labels, _ in scrape(url, READ).samples.get(VALID, [])}
    return ids.pop() if len(ids) == 1 else None


def _wait(probe: Callable[[], str | None], timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout:.0f} s")


def warm(engines: list[Engine], requests: int = 4) -> None:
    """A few short requests per engine (first requests pay one-time costs); then every engine idle."""
    with ThreadPoolExecutor(max_workers=requests * len(engines)) as pool:
        jobs = [pool.submit(complete, engine.server.url, [5 + i] * 64, 16, stream=True)
                for engine in engines for i in range(requests)]
        for job in jobs:
            job.result(timeout=600)
    wait_idle(engines)


HEADER = ("| policy | completed | OOMs | preemptions | tokens/s | p50 latency s | p99 latency s | p99 TTFT s | "
          "p99 router wait s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def table(rows: list[Row]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [HEADER]
    for row in rows:
        rejected = f" ({row.rejected} rejected)" if row.rejected else ""
        lines.append(f"| {row.policy} | {row.completed}/{row.requests}{rejected} | {row.died} | {row.preemptions} | "
                     f"{row.tokens_per_s:,.1f} | {cell(row.p50_latency_s)} | {cell(row.p99_latency_s)} | "
                     f"{cell(row.p99_ttft_s)} | {cell(row.p99_router_s)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--requests", type=int, default=60, help="the trace's first N requests")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="the trace's draws")
    parser.add_argument("--token-scale", type=float, default=1 / 8)
    parser.add_argument("--time-scale", type=float, default=0.125)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--write", type=Path, default=None, help="replace the real fleet's block in this file")
    args = parser.parse_args()
    if not (ENGINE / ".installed").exists():
        print(f"vLLM's CPU build is not installed in {ENGINE}: run `make engines`")
        return 2
    trace = load_trace(TRACE)
    draws = {seed: scaled(trace.requests(seed), args.requests, args.token_scale, args.time_scale)
             for seed in args.seeds}
    kv_tokens = round(SIM_KV_TOKENS * args.token_scale)
    began = time.monotonic()
    runs: dict[str, list[Run]] = {name: [] for name in args.policies}
    with tempfile.TemporaryDirectory(prefix="bench-real-fleet-") as scratch:
        engines = []
        try:
            engines = start_engines(args.engines, Path(scratch), kv_tokens)
            warm(engines)
            salt = 0
            for seed, requests in draws.items():  # the policies in turn on each draw: drifting load falls on all
                for name in args.policies:
                    salt += 1  # every replay's prompts are new to the engines
                    run = runs[name]
                    run.append(run_policy(name, engines, requests, seed, salt))
                    print(f"seed {seed} {name}: {summarize(name, run[-1:])}", flush=True)
        finally:
            for engine in engines:
                engine.server.stop(signal.SIGTERM, timeout=120)
                engine.sidecar.stop()
    every = [r for requests in draws.values() for r in requests]
    spans = ", ".join(f"{requests[-1].arrival_ns / NS_PER_S:.0f}" for requests in draws.values())
    note = (f"{TRACE}, seeds {', '.join(map(str, args.seeds))}: the first {args.requests} requests of each draw, token "
            f"lengths × {args.token_scale:g} (prompts {min(r.prompt_tokens for r in every)}–"
            f"{max(r.prompt_tokens for r in every)}, outputs {min(r.output_tokens for r in every)}–"
            f"{max(r.output_tokens for r in every)} tokens), arrivals × {args.time_scale:g} (the last at {spans} s); "
            f"{args.engines} vLLM CPU engines of {kv_tokens // BLOCK_SIZE} KV blocks of {BLOCK_SIZE} tokens; "
            f"{os.cpu_count()} CPUs shared with other work; {time.monotonic() - began:.0f} s in all. Counts summed "
            "over the seeds, tokens/s averaged, percentiles over every request of every seed.")
    command = " ".join([".venv/bin/python bench/bench_real_fleet.py", *sys.argv[1:]])
    block = f"{note}\nWritten by `{command}`.\n\n{table([summarize(name, run) for name, run in runs.items()])}"
    print(f"\n{block}")
    if args.write is not None:
        replace_block(args.write, BEGIN, END, block)  # the simulated matrix is left alone
    return 0


if __name__ == "__main__":
    sys.exit(main())
