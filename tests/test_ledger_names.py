"""One name per quantity across demo, check, plan and explain, and printed ledgers whose lines sum exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.sim.demo import render, summarise
from memwatch.sim.scenario import Scenario

from processes import query
from stored_runs import store_scenario

MiB = 1 << 20
CONTEXT_BYTES = 512 * MiB  # the simulated GPU's CUDA context: the only memory outside the allocator in the demo
EXACT = re.compile(r"^\s*([−=]?)\s*(.+?)\s{2,}\S+ \S+\s+(-?[\d,]+)(?:\s{2}.*)?$")


@pytest.fixture
def demo_run(runtime_dir: Path, db_path: Path) -> str:
    return store_scenario("demo", runtime_dir, db_path)


def _ledger(lines: list[str], first: str) -> list[tuple[str, str, int]]:
    """The rows of a printed ledger from its first line through its ``=`` line: (sign, label, exact bytes)."""
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first))
    rows = []
    for line in lines[start:]:
        match = EXACT.match(line)
        assert match, line
        rows.append((match[1], match[2].strip(), int(match[3].replace(",", ""))))
        if match[1] == "=":
            return rows
    raise AssertionError("the ledger has no = line")


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {key for item in value.values() for key in _keys(item)}
    if isinstance(value, list):
        return {key for item in value for key in _keys(item)}
    return set()


def _cli(db_path: Path, *args: str) -> str:
    result = CliRunner().invoke(main, [*args, "--db", str(db_path)])
    assert result.exit_code in (0, 1), result.output
    return result.output


def test_the_demo_budget_lines_sum_to_the_kv_cache(demo_run: str, db_path: Path) -> None:
    text = render(summarise(db_path, demo_run, Scenario.load("demo"))).splitlines()
    rows = _ledger(text, "total × utilization")
    (_, _, budget), *terms, (sign, label, kv) = rows
    assert (sign, label) == ("=", "KV cache")
    assert budget == int(24 * 2**30 * 0.9) == 23_192_823_398
    assert kv == 347 * 14_680_064
    assert budget - sum(value for _, _, value in terms) == kv
    named = {label: value for _, label, value in terms}
    # Non-PyTorch is used − reserved: the simulated context alone; the engine's used − current adds the slack.
    assert named["non-PyTorch"] == CONTEXT_BYTES
    (used, current), = query(db_path, "SELECT json_extract(data, '$.used_bytes'), json_extract(data, "
                             "'$.current_bytes') FROM events WHERE kind = 'kv_allocated'")
    assert named["non-PyTorch"] + named["cache slack"] == used - current


def test_the_check_ledger_sums_to_the_budget_and_names_match_every_command(demo_run: str, db_path: Path) -> None:
    lines = _cli(db_path, "check", "latest").splitlines()
    rows = _ledger(lines, "budget (total × utilization)")
    (_, _, budget), *terms, (sign, label, headroom) = rows
    assert sign == "=" and label.startswith("headroom")
    assert budget - sum(value for _, _, value in terms) == headroom
    (used, reserved), = query(db_path, "SELECT driver_used_bytes, reserved_bytes FROM samples WHERE rank = 0 "
                              "ORDER BY ts_ns DESC, step DESC LIMIT 1")
    named = {label: value for _, label, value in terms}
    assert named["non-PyTorch (used − reserved)"] == used - reserved == CONTEXT_BYTES

    check = json.loads(_cli(db_path, "check", "latest", "--json"))
    plan = json.loads(_cli(db_path, "plan", "--run", "latest", "--json"))
    explain = json.loads(_cli(db_path, "explain", "latest", "--json"))
    assert check["ranks"][0]["last_terms"]["non_torch_bytes"] == used - reserved
    plan_terms = {term["term"]: term["measured_bytes"] for comparison in (plan if isinstance(plan, list) else
                                                                            plan.get("ranks", [plan]))
                  for term in comparison["terms"]}
    assert plan_terms["non-PyTorch"] == CONTEXT_BYTES
    for document in (check, plan, explain):
        assert "non_pytorch_bytes" not in _keys(document)
