"""``report --json``: the report's numbers, the shared quantities under the keys ``check`` gives them."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from memwatch.cli import main
from memwatch.store.run_figures import SHARED_KEYS

from stored_runs import store_scenario

QWEN3_06B_WEIGHTS = 2 * 596_049_920
"""Qwen3-0.6B's parameters in bf16, unsharded."""


def _stored(tmp_path: Path, name: str) -> tuple[Path, str]:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db = tmp_path / "m.db"
    return db, store_scenario(name, runtime, db, live=True)


def test_report_json_gives_the_shared_quantities_of_check(tmp_path: Path) -> None:
    db, run_id = _stored(tmp_path, "torch_leak_tp4")
    result = CliRunner().invoke(main, ["--db", str(db), "report", run_id, "--json"])
    assert result.exit_code == 0, result.output
    numbers = json.loads(result.stdout)
    check = json.loads(CliRunner().invoke(main, ["--db", str(db), "check", run_id, "--json"]).stdout)
    assert {key: numbers[key] for key in SHARED_KEYS} == {key: check[key] for key in SHARED_KEYS}
    assert numbers["run_id"] == run_id and numbers["outcome"] == "oom"
    # the scenario's model and engine; its [gpu] names no device, so the simulator's default name
    assert (numbers["status"], numbers["engine"], numbers["model"], numbers["gpu"]) == (
        "oom", "nano-vllm", "Qwen3-0.6B", "Virtual GPU")
    ranks = numbers["ranks"]
    assert [rank["rank"] for rank in ranks] == [0, 1, 2, 3]
    # four equal shards of one model (norms replicated on each, so a bit more than the model's 1,192,099,840 B)
    assert numbers["weights_bytes"] == 4 * ranks[0]["weights_bytes"] > QWEN3_06B_WEIGHTS
    for rank in ranks:
        assert rank["kv_cache_bytes"] == rank["num_blocks"] * rank["block_bytes"]
    assert sum(rank["kv_cache_bytes"] for rank in ranks) == numbers["kv_cache_bytes"]
    # the leak is on rank 2 alone: it ran out, at the run's step, with the run's (negative) margin
    assert [rank["oom_step"] for rank in ranks] == [None, None, numbers["oom_step"], None]
    assert ranks[2]["oom_margin_bytes"] == numbers["oom_margin_bytes"] <= 0
    assert ranks[2]["flag_counts"] == numbers["flag_counts"]
    assert any("rank 2 ran out of memory" in sentence for sentence in numbers["explanation"])


def test_report_json_with_a_file_writes_it_and_names_it(tmp_path: Path) -> None:
    db, run_id = _stored(tmp_path, "demo")
    page = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["--db", str(db), "report", run_id, "-o", str(page), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["path"] == str(page) and page.stat().st_size > 0


def test_report_needs_a_file_or_json(tmp_path: Path) -> None:
    db, run_id = _stored(tmp_path, "demo")
    result = CliRunner().invoke(main, ["--db", str(db), "report", run_id])
    assert result.exit_code == 2 and "-o FILE.html" in result.output


def test_a_rank_without_shared_quantities_has_no_margin() -> None:
    """A rank the report draws but the ledger never saw (no sizing, no summary): its margin is unknown, not another
    rank's."""
    from memwatch.report.facts import RankFacts
    from memwatch.report.numbers import rank_numbers
    from memwatch.store.run_figures import RankTruth, RunTruth

    facts = RankFacts(rank=1, status="ok", samples=3, last_step=2, weights_bytes=None, torch_other_bytes=None,
                      activation_reserve_bytes=None, non_pytorch_bytes=None, num_blocks=None, block_bytes=None,
                      kv_bytes=None, budget_bytes=None, peak_used_bytes=None, min_free_bytes=None,
                      serving_peak_bytes=None, preemptions=0, flags={}, oom_requested_bytes=None, oom_step=None)
    truth = RunTruth("run", (RankTruth(0, None, None, 1, 5, 2, 3),))
    row = rank_numbers(facts, truth)
    assert row["oom_margin_bytes"] is None and row["flag_counts"] == {} and "flags" not in row
    assert rank_numbers(RankFacts(**{**facts.to_dict(), "rank": 0}), truth)["oom_margin_bytes"] == 5


def test_the_html_report_of_a_cpu_run_says_once_why_its_rows_are_empty(tmp_path: Path) -> None:
    """A run whose ranks record the CPU device (as vLLM's CPU build's do, with the CPU probe's note): the page says
    once which terms a CPU leaves unmeasured; a GPU run's page says nothing of the kind."""
    import sqlite3

    from memwatch_engine.probes.cpu import CPU_DEVICE

    db, run_id = _stored(tmp_path, "demo")
    gpu_page = tmp_path / "gpu.html"
    assert CliRunner().invoke(main, ["--db", str(db), "report", run_id, "-o", str(gpu_page)]).exit_code == 0
    assert "id='device'" not in gpu_page.read_text()
    conn = sqlite3.connect(db)
    conn.execute("UPDATE ranks SET gpu_name = 'CPU', probe_unavailable = ? WHERE run_id = ?", (CPU_DEVICE, run_id))
    conn.commit()
    conn.close()
    page = tmp_path / "cpu.html"
    result = CliRunner().invoke(main, ["--db", str(db), "report", run_id, "-o", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert text.count("<p id='device'>This run's device is a CPU: it has no allocator reserve, driver used and free"
                      ) == 1
    assert "are the engine&#x27;s own. The table's empty rows are why, not unknowns.</p>" in text
