"""``memwatch explain`` on the simulator's scenarios: what each account must say, and what it must not.

Each expectation is written from the scenario's definition (``memwatch/sim/scenarios/NAME.toml``: its
faults, their steps and sizes, its expected status), not from what ``explain`` printed. Every scenario
is stored once, as the sidecar stores it, and read through the command a user runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.report.causes import new_segment_bytes

from stored_runs import store_scenario

MiB = 1 << 20


@dataclass(frozen=True)
class Expected:
    outcome: str
    must: tuple[str, ...]
    """Phrases the printed account must hold."""
    first_cause: str | None = None
    """The cause said first (most bytes behind it), for a run that ended badly."""
    must_not: tuple[str, ...] = ()
    """Phrases it must not hold, beyond :data:`NEVER`."""


NEVER = (
    "ring",                     # memwatch's insides: a user never sees one
    "0 steps (0 s) before",     # a jump within the failing step is that step's own tensors, not a lead
    "tightest moment was step 0",
    " 1 flags",
    "0 B free",                 # said as "no memory free"
    "SIGKILL",
)
"""Never said of any of these scenarios."""
GRAPHS = "CUDA graphs captured after sizing"
LEAKS = ("leak inside", "leak outside", "the leak", "leaked", "leaking")
"""A leak claimed; "not a leak" of a clean run's CUDA graphs is no such claim."""

EXPECTED: dict[str, Expected] = {
    # Clean runs: no fault, no flag expected, so no cause and no out-of-memory; the margin is a serving one.
    # nano-vllm captures its CUDA graphs after sizing them out of its budget: a finding with its size, said to be
    # no leak (the demo's 385,628,160 B = 367.76 MiB, derived in test_check_graphs.py).
    "clean_chat": Expected("ok", ("no rank ran out of memory; no flags.", "serving", GRAPHS),
                           must_not=("ran out of memory at", "cause", *LEAKS, "fragment")),
    "demo": Expected("ok", ("no rank ran out of memory; no flags.", "serving", f"{GRAPHS}: 367.76 MiB", "not a leak"),
                     must_not=("ran out of memory at", *LEAKS, "fragment")),
    # Warmup ran as a decode step: the reserve is a 4-token decode's, the 16,384-token wave's prefill fails.
    "warmup_decode": Expected(
        "oom", ("ran out of memory at step", "larger than the activation reserve warmup measured",
                "under-measured activation"),
        first_cause="activation_over_reserve",
        must_not=("jumped by", "Another process", "leak", "fragment", "OOM killer")),
    # 2.5 MiB a step from step 200 outside PyTorch until the leaking cudaMalloc fails: a crash, the device full.
    "non_torch_leak": Expected(
        "crashed", ("no out-of-memory was recorded", "with the device full", "leak outside PyTorch",
                    "since step 199", "the run crashed"),
        first_cause="leak_outside_pytorch",
        must_not=("OOM killer", "Another process", "nearly full, a likely cause", "last 100 samples",
                  "leak inside PyTorch")),
    # 2.5 MiB a step kept allocated from step 200; the last request is one leaked step's 2.5 MiB, which the
    # allocator serves from a 20 MiB segment (PyTorch's rule for requests from 1 MiB to under 10 MiB).
    "torch_leak": Expected(
        "oom", ("a request for 2.5 MiB failed", "leak inside PyTorch", "since step 199",
                f"new {new_segment_bytes(int(2.5 * MiB)) // MiB}.0 MiB segment"),
        first_cause="leak_inside_pytorch",
        must_not=("Another process", "leak outside PyTorch", "fragment")),
    # From step 300 a pinned segment every 10 steps: free cache split in pieces, fragmentation named.
    "fragmentation": Expected(
        "oom", ("ran out of memory at step", "fragmentation", "empty_cache cannot release"),
        first_cause="fragmentation",
        must_not=("leak", "Another process")),
    # Another process takes every free byte at step 100: its bytes are the cause, named as another process.
    "other_process_oom": Expected(
        "oom", ("Another process took", "after step 99"),
        first_cause="other_process",
        must_not=("Non-PyTorch memory jumped", *LEAKS, "fragment")),
    # Bursty traffic grows the allocator's cache; from step 600 2 MiB a step leaks outside PyTorch until a crash:
    # the leak is the cause, since step 599, and the cache PyTorch can reuse is at most a contributor, said after.
    "non_torch_leak_bursty": Expected(
        "crashed", ("leak outside PyTorch", "since step 599"), first_cause="leak_outside_pytorch",
        must_not=("OOM killer", "fragment", "request")),
    # Rank 1 leaks outside PyTorch and dies with its device full; rank 0, with room to spare, stops with it.
    "non_torch_leak_tp2": Expected(
        "crashed", ("rank 1 crashed after step", "leak outside PyTorch", "rank 0 still had",
                    "likely stopped with rank 1"),
        first_cause="leak_outside_pytorch", must_not=("OOM killer", "do not point to GPU memory")),
    # Another process holds 2 GiB from step 300 to 700; sized at 0.6 the engine survives; one flag.
    "other_process": Expected("ok", ("no rank ran out of memory; 1 flag (1 external_process",),
                              must_not=("ran out of memory at",)),
    # Too much load for 113 blocks: preemptions, flagged kv_pressure, no out-of-memory.
    "kv_pressure": Expected("ok", ("no rank ran out of memory;", " kv_pressure;"),
                            must_not=("ran out of memory at", *LEAKS)),
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each scenario stored once, with the sidecar's live detectors: its database and run id."""
    runs = {}
    for name in EXPECTED:
        base = tmp_path_factory.mktemp(name)
        runtime = base / "run"
        runtime.mkdir(mode=0o700)
        runs[name] = base / "memwatch.db", store_scenario(name, runtime, base / "memwatch.db", live=True)
    return runs


def _explain(stored: dict[str, tuple[Path, str]], name: str) -> tuple[list[str], dict[str, Any]]:
    db, run_id = stored[name]
    text = CliRunner().invoke(main, ["explain", run_id, "--db", str(db)])
    data = CliRunner().invoke(main, ["explain", run_id, "--db", str(db), "--json"])
    assert text.exit_code == 0 and data.exit_code == 0, text.output + data.output
    return text.output.splitlines()[1:], json.loads(data.output)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_scenario_is_told_what_happened_and_nothing_else(stored: dict[str, tuple[Path, str]],
                                                              name: str) -> None:
    expected = EXPECTED[name]
    lines, data = _explain(stored, name)
    text = "\n".join(lines)
    assert data["outcome"] == expected.outcome
    assert [phrase for phrase in expected.must if phrase not in text] == [], text
    assert [phrase for phrase in (*NEVER, *expected.must_not) if phrase in text] == [], text
    # No sentence twice, and one window per rank at most (not a second, near-identical one).
    assert len(lines) == len(set(lines))
    windows = [line for line in lines if "free memory went from" in line or ("free memory " in line and " -> " in line)]
    assert len(windows) <= len(data["readings"]), windows
    if expected.first_cause is not None:
        (end,) = data["ooms"]
        assert end["causes"][0] == expected.first_cause, end["causes"]


def test_the_allocator_asks_the_driver_for_whole_segments() -> None:
    # PyTorch's get_allocation_size: 2 MiB up to 1 MiB, 20 MiB under 10 MiB, else the request rounded to 2 MiB
    # (after every request is rounded up to 512 bytes).
    assert [new_segment_bytes(size) for size in (1, 1 * MiB, 1 * MiB + 1, int(2.5 * MiB), 10 * MiB - 512,
                                                  10 * MiB - 511, 10 * MiB, 173 * MiB + 1, 174 * MiB)] == [
        2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 10 * MiB, 174 * MiB, 174 * MiB]
