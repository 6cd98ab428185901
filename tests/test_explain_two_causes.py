"""Two causes outside PyTorch on one rank: a leak and another process, each told with its own size and onset.

A leak of 2.5 MiB a step outside PyTorch and another process taking 1 GiB at a given step both raise
non-PyTorch memory; ``explain`` once put the whole rise (2.9 GiB) on the other process, from the leak's onset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.detectors.wording import format_bytes

from stored_runs import store_scenario

MIB = 1 << 20
GIB = 1 << 30
LEAK_PER_STEP = 5 * MIB // 2

SCENARIO = """
name = "leak_and_other_process"
description = "a leak outside PyTorch plus another process of 1 GiB"
model = "Qwen3-0.6B"

[gpu]
total_bytes = 8_589_934_592

[engine]
gpu_memory_utilization = 0.6
max_num_batched_tokens = 4096
max_model_len = 4096

[[workload.requests]]
count = 8
prompt_tokens = 1024
output_tokens = 2000

[[faults]]
kind = "non_torch_leak"
bytes_per_step = {leak}
from_step = {leak_from}

[[faults]]
kind = "other_process"
size_bytes = {other}
at_step = {other_at}
"""


@pytest.mark.parametrize(("leak_from", "other_at"), [(300, 900), (600, 300)])
def test_each_cause_has_its_own_size_and_onset(tmp_path: Path, leak_from: int, other_at: int) -> None:
    scenario = tmp_path / "two.toml"
    scenario.write_text(SCENARIO.format(leak=LEAK_PER_STEP, leak_from=leak_from, other=GIB, other_at=other_at))
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db = tmp_path / "m.db"
    run_id = store_scenario(scenario, runtime, db, live=True)
    result = CliRunner().invoke(main, ["--db", str(db), "explain", run_id])
    assert result.exit_code == 0, result.output
    text = result.stdout
    last_step = int(text.split("last record is rank 0 step ")[1].split(" ")[0].replace(",", ""))
    # the leak's samples are level up to the step before it starts, then rise every step up to the last
    leaked = (last_step - (leak_from - 1)) * LEAK_PER_STEP
    assert (f"Memory outside PyTorch's allocator grew by {format_bytes(leaked)} over "
            f"{last_step - (leak_from - 1):,} steps") in text
    assert f"since step {leak_from - 1:,}, while PyTorch's own numbers stayed flat" in text
    assert f"Another process took {format_bytes(GIB)} of this GPU at step {other_at:,}:" in text
    data = json.loads(CliRunner().invoke(main, ["--db", str(db), "explain", run_id, "--json"]).stdout)
    assert sorted(data["ooms"][0]["causes"]) == ["leak_outside_pytorch", "other_process"]
