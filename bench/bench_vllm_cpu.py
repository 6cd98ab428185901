"""What memwatch costs a real served engine: vLLM's CPU build, the same model and requests, memwatch on and off.

Two ``vllm serve`` (``.engines/vllm-cpu``, ``make engines``) of the tiny Qwen2 model the tests use, one with
``MEMWATCH=1`` (the plugin starts its sidecar, which stores every step), one without, both up at once and
measured in turns (off then on, on then off, ...) so that a machine's drifting load falls on both alike;
the idle one waits. Each turn sends the same token-id prompts from concurrent streaming HTTP clients and times
what a client sees: output tokens/s over the turn, time to first token and the gaps between tokens
(p50, p99); and the CPU seconds the server's processes (and memwatch's sidecar) spent per 1,000 output
tokens, which a machine shared with other work disturbs far less than the wall clock. The goal: memwatch
on keeps at least 98 % of the tokens/s off (the median of each turn's on/off ratio).

Minutes (two engine start-ups), so it is not in the smoke run of the benchmarks (``tests/test_bench_smoke.py``).

Run: .venv/bin/python bench/bench_vllm_cpu.py [--turns 10] [--requests 16] [--clients 8] [--prompt 128] [--output 128]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from vllm_cpu import ENGINE, Completion, Server, descendants, load, prompts, write_model

from memwatch_engine.spawn import sidecar_pid

GOAL = 0.98


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0–1) by the nearest rank, of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (``/proc/PID/stat``); a process gone counts nothing."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def turn(server: Server, batch: list[list[int]], output: int, clients: int,
         sidecar: int | None = None) -> tuple[float, float, float, list[Completion]]:
    """Output tokens/s, and CPU seconds per 1,000 output tokens of the server's processes and of the sidecar."""
    engine = [server.proc.pid, *descendants(server.proc.pid)]
    cpu, side = cpu_seconds(engine), cpu_seconds([sidecar] if sidecar else [])
    began = time.monotonic()
    done = load(server.url, batch, output, clients=clients, stream=True)
    elapsed = time.monotonic() - began
    assert all(c.output_tokens == output for c in done), [c.output_tokens for c in done]
    tokens = sum(c.output_tokens for c in done)
    return (tokens / elapsed, (cpu_seconds(engine) - cpu) * 1000 / tokens,
            (cpu_seconds([sidecar] if sidecar else []) - side) * 1000 / tokens, done)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    args = parser.parse_args()
    if not (ENGINE / ".installed").exists():
        print(f"vLLM's CPU build is not installed in {ENGINE}: run `make engines`")
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-vllm-cpu-") as scratch:
        folder = Path(scratch)
        model = write_model(folder / "qwen2-tiny")
        runtime = folder / "run"
        runtime.mkdir(mode=0o700)
        common = ("--kv-cache-memory-bytes", str(64 << 20))
        servers = {
            "off": Server(model, folder / "off.log", {}, common),
            "on": Server(model, folder / "on.log", {"MEMWATCH": "1", "MEMWATCH_RUNTIME_DIR": str(runtime),
                                                     "MEMWATCH_DB": str(folder / "memwatch.db")}, common),
        }
        try:
            for name, server in servers.items():
                server.start()
                print(f"memwatch {name}: vllm serve answered after {server.startup_s:.1f} s", flush=True)
            batch = prompts(args.requests, args.prompt)
            for server in servers.values():  # warm both: first requests pay one-time costs
                turn(server, batch[: args.clients], 16, args.clients)
            sidecar = sidecar_pid(runtime)
            rates: dict[str, list[float]] = {"off": [], "on": []}
            cpu: dict[str, list[float]] = {"off": [], "on": [], "sidecar": []}
            seen: dict[str, list[Completion]] = {"off": [], "on": []}
            for index in range(args.turns):
                for name in ("off", "on") if index % 2 == 0 else ("on", "off"):
                    rate, engine_cpu, side_cpu, done = turn(servers[name], batch, args.output, args.clients,
                                                            sidecar if name == "on" else None)
                    rates[name].append(rate)
                    cpu[name].append(engine_cpu)
                    if name == "on":
                        cpu["sidecar"].append(side_cpu)
                    seen[name] += done
                    print(f"turn {index + 1} memwatch {name}: {rate:,.0f} output tokens/s, {engine_cpu:.3f} CPU s "
                          "per 1k tokens", flush=True)
        finally:
            for server in servers.values():
                server.stop(signal.SIGTERM, timeout=120)
        print(f"\n{args.requests} requests × ({args.prompt} prompt + {args.output} output tokens), {args.clients} "
              f"streaming clients, {args.turns} turns each, {os.cpu_count()} CPUs")
        print(f"{'memwatch':<9} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9} "
              f"{'engine CPU s/1k tok':>20}")
        for name in ("off", "on"):
            ttft = [c.ttft_s * 1e3 for c in seen[name]]
            itl = [gap * 1e3 for c in seen[name] for gap in c.itl_s]
            print(f"{name:<9} {statistics.median(rates[name]):>9,.0f} {percentile(ttft, .5):>7.1f}ms "
                  f"{percentile(ttft, .99):>7.1f}ms {percentile(itl, .5):>7.2f}ms {percentile(itl, .99):>7.2f}ms "
                  f"{statistics.median(cpu[name]):>20.3f}")
        print(f"the sidecar (a process of its own): {statistics.median(cpu['sidecar']):.3f} CPU s per 1k tokens")
    # Each turn's on/off ratio, against the off turn beside it: the machine's load drifts less within a pair.
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    ratio = statistics.median(ratios)
    verdict = "met" if ratio >= GOAL else "MISSED"
    print(f"on/off tokens/s per turn: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"on/off tokens/s, median of the turns: {ratio:.3f} (goal ≥ {GOAL}): {verdict}")
    return 0 if ratio >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
