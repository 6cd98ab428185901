"""CUDA graphs nano-vllm captures after sizing are said, with check's number, in the report and in explain.

The demo's graphs: 20,711,891,968 B allocated after the capture − 20,326,263,808 B before it =
385,628,160 B = 367.76 MiB (tests/test_check_graphs.py derives it from the stored samples). A run
without graphs outside the budget (clean_eager captures none; torch_leak's rise is a leak far beyond
its graphs) gets neither the sentence nor a number.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.report.output import write_report
from memwatch.store import open_store

from chromium import open_page
from stored_runs import store_scenario

DEMO_GRAPHS = 385_628_160
SENTENCE = ("CUDA graphs captured after sizing: 367.76 MiB outside the budget nano-vllm sized the KV cache against "
            "(nano-vllm does not count them); they are the other long-lived PyTorch now, not a leak")
SAID = "CUDA graphs captured after sizing"
SUMMARY = """(() => {
  const table = document.getElementById('summary');
  if (!table) return null;
  const findings = document.getElementById('findings');
  const rows = [...table.querySelectorAll('tr')].map(row => [...row.cells].map(cell => cell.innerText));
  return JSON.stringify({rows, findings: findings ? findings.innerText : null,
                         explain: document.getElementById('explain').innerText});
})()"""


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], tuple[Path, str]]]:
    runs: dict[str, tuple[Path, str]] = {}

    def get(name: str) -> tuple[Path, str]:
        if name not in runs:
            base = tmp_path_factory.mktemp(name)
            (base / "run").mkdir(mode=0o700)
            runs[name] = base / "memwatch.db", store_scenario(name, base / "run", base / "memwatch.db", live=True)
        return runs[name]

    yield get


def _json(db: Path, *args: str) -> Any:
    result = CliRunner().invoke(main, ["--db", str(db), *args, "--json"])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


def _text(db: Path, *args: str) -> str:
    result = CliRunner().invoke(main, ["--db", str(db), *args])
    assert result.exit_code in (0, 1), result.output
    return result.stdout


def test_the_demos_page_says_its_graphs_in_the_summary(stored: Callable[[str], tuple[Path, str]],
                                                       tmp_path: Path) -> None:
    db_path, run_id = stored("demo")
    out = write_report(open_store(db_path), run_id, tmp_path / "demo.html")
    facts = json.loads(open_page(out.as_uri(), SUMMARY).value)
    row = next(row for row in facts["rows"] if row[0] == "CUDA graphs outside the budget")
    assert row[1:] == ["367.76 MiB"]
    assert facts["findings"] is not None
    assert f"rank 0: {SENTENCE}." in facts["findings"]
    assert f"rank 0: {SENTENCE}." in facts["explain"]


def test_explain_says_the_demos_graphs_with_checks_number(stored: Callable[[str], tuple[Path, str]]) -> None:
    db_path, run_id = stored("demo")
    check = _json(db_path, "check", run_id)["ranks"]
    explain = _json(db_path, "explain", run_id)
    assert [rank["cuda_graphs_outside_budget_bytes"] for rank in check] == [DEMO_GRAPHS]
    assert explain["ranks"] == [{"rank": 0, "cuda_graphs_outside_budget_bytes": DEMO_GRAPHS}]
    assert f"rank 0: {SENTENCE}." in explain["sentences"]
    assert explain["sentences"].count(f"rank 0: {SENTENCE}.") == 1
    assert f"rank 0: {SENTENCE}." in _text(db_path, "explain", run_id).splitlines()


@pytest.mark.parametrize("name", ["torch_leak", "clean_eager"])
def test_no_graphs_outside_the_budget_nothing_said(stored: Callable[[str], tuple[Path, str]], tmp_path: Path,
                                                   name: str) -> None:
    db_path, run_id = stored(name)
    assert [rank["cuda_graphs_outside_budget_bytes"] for rank in _json(db_path, "check", run_id)["ranks"]] == [None]
    explain = _json(db_path, "explain", run_id)
    assert [rank["cuda_graphs_outside_budget_bytes"] for rank in explain["ranks"]] == [None]
    assert not any(SAID in sentence for sentence in explain["sentences"])
    assert SAID not in _text(db_path, "explain", run_id)
    page = write_report(open_store(db_path), run_id, tmp_path / f"{name}.html").read_text(encoding="utf-8")
    assert SAID not in page
    assert "CUDA graphs outside the budget" not in page
    assert "id='findings'" not in page
