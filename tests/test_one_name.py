"""One number, one name: a quantity a command prints twice is printed the same both times."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner

from memwatch.cli import main

from stored_runs import store_scenario


def test_plan_that_does_not_fit_names_the_budget_its_table_ends_with() -> None:
    """On 12 GiB a 7B model leaves a negative KV budget; the verdict once said "the KV budget is 0 B" beside the
    table's negative one, so its "short by" (required − budget) did not add up from what it said."""
    args = ["plan", "--gpu-memory", "12GiB", "--seqs", "4", "--seq-len", "4096"]
    text = CliRunner().invoke(main, args).output
    table = re.search(r"^= KV budget\s+(-?[\d,]+) B\s+(\S+ \S+)$", text, re.M)
    assert table is not None, text
    budget_bytes, budget_text = int(table.group(1).replace(",", "")), table.group(2)
    assert budget_bytes < 0
    short = re.search(r"short by \S+ \S+ \(([\d,]+) B\)", text)
    need = re.search(r"need (\S+ \S+) of KV; the KV budget is (\S+ \S+)$", text, re.M)
    assert short is not None and need is not None, text
    assert need.group(2) == budget_text
    # 4 sequences × 16 blocks of 256 tokens × 14 MiB (Qwen2.5-7B: 28 layers × 4 KV heads × 128 × 2 (K, V) × 2 B)
    required = 4 * 16 * 256 * 28 * 4 * 128 * 2 * 2
    assert need.group(1) == "896.00 MiB" and required == 939_524_096
    assert int(short.group(1).replace(",", "")) == required - budget_bytes
    data = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    assert data["kv_budget_bytes"] == budget_bytes and data["shortfall_bytes"] == required - budget_bytes


def test_runs_names_virtual_gpus_one_way(tmp_path: Path) -> None:
    """The demo's GPU is named "Virtual GPU 24GiB"; a scenario that names none gets its size added the same way
    ("Virtual GPU 16GiB", 16 × 2^30 B), not "Virtual GPU 16.00 GiB"."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db = tmp_path / "m.db"
    store_scenario("demo", runtime, db)
    scenario = tmp_path / "plain.toml"
    scenario.write_text(PLAIN_GPU.format(total=16 << 30))
    store_scenario(scenario, runtime, db)
    text = CliRunner().invoke(main, ["--db", str(db), "runs"]).output
    assert "/ Virtual GPU 24GiB" in text and "/ Virtual GPU 16GiB" in text, text
    assert "16.00 GiB" not in text


PLAIN_GPU = """
name = "plain_gpu"
model = "Qwen3-0.6B"

[gpu]
total_bytes = {total}

[engine]
gpu_memory_utilization = 0.6
max_model_len = 4096

[[workload.requests]]
count = 1
prompt_tokens = 256
output_tokens = 8
"""


def test_one_flag_is_said_in_the_singular(tmp_path: Path) -> None:
    """rank_imbalance raises exactly one flag (its ranks sized 431 and 358 blocks): "1 flag", not "1 flags"."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db = tmp_path / "m.db"
    run_id = store_scenario("rank_imbalance", runtime, db, live=True)
    lines = CliRunner().invoke(main, ["--db", str(db), "check", run_id]).output.splitlines()
    assert lines[-1] == "check failed: 1 flag of warning or worse"


def test_counted() -> None:
    from memwatch.detectors.wording import counted

    assert [counted(n, "step") for n in (0, 1, 2, 1200)] == ["0 steps", "1 step", "2 steps", "1,200 steps"]


def test_reading_runs_gives_the_buckets_default_the_cli_has() -> None:
    from memwatch.report.series import DEFAULT_BUCKETS

    doc = (Path(__file__).resolve().parent.parent / "docs" / "reading-runs.md").read_text()
    stated = re.search(r"`--buckets` \(default ([\d,]+)\)", doc)
    assert stated is not None
    assert int(stated.group(1).replace(",", "")) == DEFAULT_BUCKETS
    help_text = CliRunner().invoke(main, ["report", "--help"]).output
    assert re.search(rf"\[default:\s+{DEFAULT_BUCKETS}[;\]]", help_text), help_text
