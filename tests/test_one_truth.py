"""One number per quantity: every reading command's ``--json`` gives a stored run's shared quantities under the
same keys and with the same values, on every shipped scenario (several ranks included) and on a crash that left
memory free; a few of them match what the scenario files imply by hand.

A run's shared quantities are at the top of ``check``, ``explain``, ``diff`` and ``report --json``, with its worst
rank (the first to run out, else the lowest margin) named there as ``worst_rank``; each rank's are in the ``ranks``
of ``check`` and ``report --json``, ``plan --run``'s rows and ``replay``'s ``original.ranks``, and ``replay``'s top
level holds its worst rank's. Each scenario is simulated once per
session (``shipped_runs``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_crash_with_memory_free import SCENARIO as CRASH_WITH_MEMORY_FREE

from memwatch.cli import main
from memwatch.sim.scenario import shipped_scenarios
from memwatch.store.run_figures import RANK_KEYS, SHARED_KEYS, worst_rank

from stored_runs import store_scenario

SCENARIOS = ("demo", "warmup_decode", "non_torch_leak", "torch_leak", "fragmentation", "other_process_oom")
"""Those whose numbers are checked by hand below."""

CRASH_FILE = "crash with memory free"
"""A scenario file of this suite's: a leak outside PyTorch until its cudaMalloc fails with 70 MiB still free."""

MIB = 1 << 20
QWEN3_06B_WEIGHTS = 2 * 596_049_920
"""Qwen3-0.6B's parameters in bf16 (2 bytes each)."""
QWEN3_06B_BLOCK = 2 * 28 * 256 * 8 * 128 * 2
"""K and V × 28 layers × 256 tokens × 8 KV heads × head_dim 128 × 2 bytes = 29,360,128."""
CONTEXT = 512 * MIB
"""The simulated CUDA context and libraries: non-PyTorch at sizing when nothing else is outside the allocator."""


@pytest.fixture(scope="module")
def crash_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("crash")
    scenario = root / "crash.toml"
    scenario.write_text(CRASH_WITH_MEMORY_FREE)
    runtime = root / "rt"
    runtime.mkdir(mode=0o700)
    db = root / "memwatch.db"
    return db, store_scenario(scenario, runtime, db, live=True)


@pytest.fixture
def stored(request: pytest.FixtureRequest, shipped_runs: Any) -> Any:
    """``stored[name]``: a shipped scenario's run, or the crash file's."""

    class Runs:
        def __getitem__(self, name: str) -> tuple[Path, str]:
            if name == CRASH_FILE:
                return request.getfixturevalue("crash_file")  # type: ignore[no-any-return]
            return shipped_runs[name]  # type: ignore[no-any-return]

    return Runs()


def _json(db: Path, *args: str, lines: bool = False) -> Any:
    result = CliRunner().invoke(main, ["--db", str(db), *args, "--json"])
    assert result.exit_code in (0, 1), result.output
    out = result.stdout
    return [json.loads(line) for line in out.splitlines()] if lines else json.loads(out)


def _shared(payload: dict[str, Any], keys: tuple[str, ...] = SHARED_KEYS) -> dict[str, Any]:
    return {key: payload[key] for key in keys if key in payload}


def _run_level(db: Path, run_id: str) -> dict[str, dict[str, Any]]:
    """Each command's shared quantities of the run as a whole."""
    diff = _json(db, "diff", run_id, run_id)
    return {"check": _shared(_json(db, "check", run_id)), "explain": _shared(_json(db, "explain", run_id)),
            "diff a": _shared(diff["a"]), "diff b": _shared(diff["b"]),
            "report --json": _shared(_json(db, "report", run_id))}


def _per_rank(db: Path, run_id: str, replayed: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """Each command's shared quantities of every rank."""
    outputs: dict[str, dict[int, dict[str, Any]]] = {
        "report --json": {row["rank"]: _shared(row, RANK_KEYS) for row in _json(db, "report", run_id)["ranks"]},
        "check": {row["rank"]: _shared(row, RANK_KEYS) for row in _json(db, "check", run_id)["ranks"]},
        "plan --run": {row["rank"]: _shared(row, RANK_KEYS) for row in _json(db, "plan", "--run", run_id)},
        "replay (original)": {row["rank"]: _shared(row, RANK_KEYS) for row in replayed["ranks"]},
    }
    last: dict[int, dict[str, Any]] = {}
    for row in _json(db, "timeline", run_id, "--ledger", lines=True):
        last[row["rank"]] = {"oom_margin_bytes": row["oom_margin_bytes"], "weights_bytes": row["weights_bytes"]}
    outputs["timeline --ledger (each rank's last row)"] = last
    # explain's window ends where a rank ran out: its margin there is that rank's end margin, not another number
    outputs["explain (windows' ends)"] = {
        oom["rank"]: {"oom_margin_bytes": oom["window"]["end"]["oom_margin_bytes"]}
        for oom in _json(db, "explain", run_id)["ooms"] if oom["window"]}
    return outputs


def _one_value(values: dict[str, Any], what: object) -> None:
    assert len({json.dumps(v, sort_keys=True) for v in values.values()}) == 1, (what, values)


@pytest.mark.parametrize("name", [*shipped_scenarios(), CRASH_FILE])
def test_every_command_gives_one_number_per_quantity(stored: Any, name: str) -> None:
    db, run_id = stored[name]
    run = _run_level(db, run_id)
    assert set(run["check"]) == set(SHARED_KEYS) == set(run["explain"]) == set(run["report --json"])
    for key in SHARED_KEYS:
        _one_value({where: shared[key] for where, shared in run.items()}, key)
    runs = _json(db, "runs")
    assert not set(SHARED_KEYS) & set(runs[0])  # runs lists runs: it has none of them, so it names none

    replayed = _json(db, "replay", run_id)["original"]
    ranks = _per_rank(db, run_id, replayed)
    numbers = sorted(ranks["report --json"])
    assert numbers and all(sorted(per) == numbers for where, per in ranks.items() if not where.startswith("explain"))
    for rank in numbers:
        for key in RANK_KEYS:
            _one_value({where: per[rank][key] for where, per in ranks.items() if key in per.get(rank, {})},
                       (rank, key))
    # the run's margin and out-of-memory step are its worst rank's: replay's top level names that rank
    report = ranks["report --json"]
    check = run["check"]
    worst = worst_rank((rank, None if row["oom_step"] is None else row["oom_step"], row["oom_margin_bytes"])
                       for rank, row in report.items())
    assert replayed["rank"] == worst
    for command in ("check", "explain", "report"):
        assert _json(db, command, run_id)["worst_rank"] == worst, command
    assert replayed["oom_step"] == check["oom_step"] == report[worst]["oom_step"]
    assert replayed["oom_margin_bytes"] == check["oom_margin_bytes"] == min(
        row["oom_margin_bytes"] for row in report.values() if row["oom_margin_bytes"] is not None)
    assert replayed["oom"] is (check["oom_step"] is not None)
    # the byte terms of the run are its ranks' summed: the whole model's weights and KV cache
    for key in ("weights_bytes", "kv_cache_bytes", "non_torch_at_sizing_bytes"):
        assert check[key] == sum(row[key] for row in report.values()), key


@pytest.mark.parametrize("name", SCENARIOS)
def test_hand_derived_values(stored: Any, name: str) -> None:
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


@pytest.mark.parametrize("name", ["non_torch_leak_h200", "non_torch_leak_tp2", CRASH_FILE])
def test_a_crash_that_left_memory_free_left_no_margin(stored: Any, name: str) -> None:
    """Each of these crashed without an out-of-memory, its last sample still showing free memory on the rank that
    ran dry (4 MiB on 141 GB, 1.5 MiB, 70 MiB on 8 GiB); that rank's margin at the end is 0 in every command,
    while a rank of the same run that still had gigabytes free keeps its own."""
    db, run_id = stored[name]
    check = _json(db, "check", run_id)
    assert check["status"] == "crashed" and check["oom_step"] is None
    for readings in check["readings"]:
        free, total = readings["last"]["driver_free_bytes"], readings["total_bytes"]
        report_rank = next(r for r in _json(db, "report", run_id)["ranks"] if r["rank"] == readings["rank"])
        if free < total // 50:
            assert report_rank["oom_margin_bytes"] <= 0
        else:
            assert report_rank["oom_margin_bytes"] > 0
    assert check["oom_margin_bytes"] <= 0


def test_non_torch_leak_numbers(stored: Any) -> None:
    """8 GiB at 0.6 with 512 MiB outside PyTorch at sizing (cache slack not counted in it); 113 blocks; a crash,
    not a PyTorch out-of-memory, so no OOM step, and the margin at the end is 0 B, not the ledger's 17.68 MiB."""
    db, run_id = stored["non_torch_leak"]
    shared = _shared(_json(db, "check", run_id))
    assert shared == {"oom_step": None, "non_torch_at_sizing_bytes": CONTEXT, "oom_margin_bytes": 0,
                      "weights_bytes": QWEN3_06B_WEIGHTS, "kv_cache_bytes": 113 * QWEN3_06B_BLOCK,
                      "flag_counts": {"non_torch_drift": 1, "oom_risk": 2}}


def test_demo_non_torch_at_sizing_excludes_cache_slack(stored: Any) -> None:
    """The report's summary once said 611.36 MiB (used − current: 512 MiB + 99.36 MiB of cache slack)."""
    from memwatch.report.facts import run_facts
    from memwatch.report.run_data import load_run_data
    from memwatch.store import open_store

    db, run_id = stored["demo"]
    facts = run_facts(load_run_data(open_store(db, readonly=True), run_id))
    assert [f.non_pytorch_bytes for f in facts] == [CONTEXT]
    assert _json(db, "check", run_id)["non_torch_at_sizing_bytes"] == CONTEXT


def test_replay_original_side_agrees(stored: Any) -> None:
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


@pytest.mark.parametrize("name", [*shipped_scenarios(), CRASH_FILE])
def test_the_bundles_ledger_gives_the_numbers_check_gives(stored: Any, name: str, tmp_path: Path) -> None:
    """An incident bundle's ``ledger.json`` holds the run's shared quantities (``run``), each rank's (``ranks``) and
    the check (``check``): the same values ``check --json`` prints, worst rank included."""
    from memwatch.incident import manifest as m
    from memwatch.incident.bundle import build_bundle
    from memwatch.incident.open import load
    from memwatch.store import open_store

    db, run_id = stored[name]
    reader = open_store(db, readonly=True)
    try:
        bundle = build_bundle(reader, run_id, "manual", tmp_path)
    finally:
        reader.conn.close()
    _manifest, members = load(bundle.read_bytes())
    ledger = json.loads(members[m.LEDGER])
    check = _json(db, "check", run_id)
    assert _shared(ledger["run"]) == _shared(check) and set(_shared(check)) == set(SHARED_KEYS)
    assert ledger["run"]["worst_rank"] == check["worst_rank"]
    assert [_shared(rank, ("rank", *RANK_KEYS)) for rank in ledger["ranks"]] == [
        _shared(rank, ("rank", *RANK_KEYS)) for rank in check["ranks"]]
    assert ledger["check"] == json.loads(json.dumps({key: check[key] for key in ledger["check"]}))
    assert json.loads(members[m.EXPLAIN])["outcome"] == _json(db, "explain", run_id)["outcome"]
