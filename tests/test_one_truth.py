"""One number per quantity: every reading command's ``--json`` gives a stored run's shared quantities under the
same keys and with the same values, and a few of them match what the scenario files imply by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.report.run_facts import SHARED_KEYS
from tests.stored_runs import store_scenario

SCENARIOS = ("demo", "warmup_decode", "non_torch_leak", "torch_leak", "fragmentation", "other_process_oom")

MIB = 1 << 20
QWEN3_06B_WEIGHTS = 2 * 596_049_920
"""Qwen3-0.6B's parameters in bf16 (2 bytes each)."""
QWEN3_06B_BLOCK = 2 * 28 * 256 * 8 * 128 * 2
"""K and V × 28 layers × 256 tokens × 8 KV heads × head_dim 128 × 2 bytes = 29,360,128."""
CONTEXT = 512 * MIB
"""The simulated CUDA context and libraries: non-PyTorch at sizing when nothing else is outside the allocator."""


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    runs = {}
    for name in SCENARIOS:
        root = tmp_path_factory.mktemp(name)
        runtime = root / "rt"
        runtime.mkdir(mode=0o700)
        db = root / "memwatch.db"
        runs[name] = (db, store_scenario(name, runtime, db, live=True))
    return runs


def _json(db: Path, *args: str, lines: bool = False) -> Any:
    result = CliRunner().invoke(main, ["--db", str(db), *args, "--json"])
    assert result.exit_code in (0, 1), result.output
    out = result.stdout
    return [json.loads(line) for line in out.splitlines()] if lines else json.loads(out)


def _shared(payload: dict[str, Any], keys: tuple[str, ...] = SHARED_KEYS) -> dict[str, Any]:
    return {key: payload[key] for key in keys if key in payload}


def _outputs(db: Path, run_id: str) -> dict[str, dict[str, Any]]:
    """Each reading command's shared quantities for ``run_id``."""
    outputs = {
        "check": _shared(_json(db, "check", run_id)),
        "explain": _shared(_json(db, "explain", run_id)),
        "diff a": _shared(_json(db, "diff", run_id, run_id)["a"]),
        "diff b": _shared(_json(db, "diff", run_id, run_id)["b"]),
    }
    rows = _json(db, "timeline", run_id, "--ledger", lines=True)
    last = rows[-1]
    outputs["timeline --ledger (last row)"] = {"oom_margin_bytes": last["oom_margin_bytes"],
                                               "weights_bytes": last["weights_bytes"]}
    # explain's last window ends where the rank ran out: its margin there is the run's end margin, not another number
    windows = [oom["window"] for oom in _json(db, "explain", run_id)["ooms"] if oom["window"] and oom["rank"] == 0]
    if windows:
        outputs["explain (last window's end)"] = {"oom_margin_bytes": windows[-1]["end"]["oom_margin_bytes"]}
    plans = _json(db, "plan", "--run", run_id)
    assert len(plans) == 1
    outputs["plan --run"] = _shared(plans[0])
    return outputs


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_command_gives_one_number_per_quantity(stored: dict[str, tuple[Path, str]], name: str) -> None:
    db, run_id = stored[name]
    outputs = _outputs(db, run_id)
    assert set(outputs["check"]) == set(SHARED_KEYS) == set(outputs["explain"])
    for key in SHARED_KEYS:
        values = {where: shared[key] for where, shared in outputs.items() if key in shared}
        assert len({json.dumps(v, sort_keys=True) for v in values.values()}) == 1, (key, values)
    runs = _json(db, "runs")
    assert not set(SHARED_KEYS) & set(runs[0])  # runs lists runs: it has none of them, so it names none


@pytest.mark.parametrize("name", SCENARIOS)
def test_hand_derived_values(stored: dict[str, tuple[Path, str]], name: str) -> None:
    db, run_id = stored[name]
    shared = _shared(_json(db, "check", run_id))
    assert shared["weights_bytes"] == (15_232_281_600 if name == "demo" else QWEN3_06B_WEIGHTS)
    if name != "demo":
        assert shared["kv_cache_bytes"] % QWEN3_06B_BLOCK == 0
    assert shared["non_torch_at_sizing_bytes"] >= CONTEXT
    ran_out = name != "demo"
    if ran_out:
        # the process died of memory: no margin was left at its end, whatever the ledger predicted
        assert shared["oom_margin_bytes"] <= 0
    else:
        assert shared["oom_margin_bytes"] > 0 and shared["oom_step"] is None and shared["flag_counts"] == {}


def test_non_torch_leak_numbers(stored: dict[str, tuple[Path, str]]) -> None:
    """8 GiB at 0.6 with 512 MiB outside PyTorch at sizing (cache slack not counted in it); 113 blocks; a crash,
    not a PyTorch out-of-memory, so no OOM step, and the margin at the end is 0 B, not the ledger's 17.68 MiB."""
    db, run_id = stored["non_torch_leak"]
    shared = _shared(_json(db, "check", run_id))
    assert shared == {"oom_step": None, "non_torch_at_sizing_bytes": CONTEXT, "oom_margin_bytes": 0,
                      "weights_bytes": QWEN3_06B_WEIGHTS, "kv_cache_bytes": 113 * QWEN3_06B_BLOCK,
                      "flag_counts": {"non_torch_drift": 1, "oom_risk": 2}}


def test_demo_non_torch_at_sizing_excludes_cache_slack(stored: dict[str, tuple[Path, str]]) -> None:
    """The report's summary once said 611.36 MiB (used − current: 512 MiB + 99.36 MiB of cache slack)."""
    from memwatch.report.facts import run_facts
    from memwatch.report.run_data import load_run_data
    from memwatch.store import open_store

    db, run_id = stored["demo"]
    facts = run_facts(load_run_data(open_store(db, readonly=True), run_id))
    assert [f.non_pytorch_bytes for f in facts] == [CONTEXT]
    assert _json(db, "check", run_id)["non_torch_at_sizing_bytes"] == CONTEXT


def test_replay_original_side_agrees(stored: dict[str, tuple[Path, str]]) -> None:
    """The original run's OOM step is the failing step that explain names, not one after it; a replay
    that also ran out of memory has no positive tightest margin."""
    db, run_id = stored["warmup_decode"]
    explain = _shared(_json(db, "explain", run_id))
    data = _json(db, "replay", run_id, "--utilization", "0.95")
    original = data["original"]
    assert original["oom_step"] == explain["oom_step"] is not None
    for key in SHARED_KEYS[:5]:
        assert original[key] == explain[key], key
    replay = data["replay"]
    if replay["oom"]:
        assert replay["tightest_oom_margin_bytes"] <= 0 and replay["oom_margin_bytes"] <= 0
