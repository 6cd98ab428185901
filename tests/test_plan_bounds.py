"""Absurd but valid model configs: every field memwatch reads has a range, and a value outside it is one
line naming the field and its range, exit code 2, at once (not a loop over 10^20 layers, not an internal
error for a 5,000-digit number)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.models.bounds import FIELD_BOUNDS

LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "bfloat16",
         "max_position_embeddings": 131072}


def _plan(config_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "absurd.json"
    path.write_text(config_text)
    return subprocess.run([sys.executable, "-m", "memwatch", "plan", "--model", str(path), "--gpu-memory", "80GiB"],
                          capture_output=True, text=True, timeout=60)


def test_a_layer_count_of_ten_to_the_twenty_is_refused_at_once(tmp_path: Path) -> None:
    done = _plan(json.dumps({**LLAMA, "num_hidden_layers": 10**20}), tmp_path)  # before: a loop for ever
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("error: model config 'absurd': num_hidden_layers is 100000000000000000000; "
                           "it must be a number from 1 to 10,000\n")


def test_a_five_thousand_digit_vocabulary_is_refused_by_name(tmp_path: Path) -> None:
    text = json.dumps(LLAMA).replace('"vocab_size": 128256', '"vocab_size": ' + "7" * 5000)
    done = _plan(text, tmp_path)  # before: an internal error (Python's int parser refuses > 4,300 digits)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("error: model config 'absurd': vocab_size is a 5,000-digit number; it must be a number "
                           "from 0 to 1,048,576\n")
    text = json.dumps({**LLAMA, "rope_theta": 1}).replace('"rope_theta": 1', '"rope_theta": ' + "3" * 5000)
    done = _plan(text, tmp_path)
    assert done.returncode == 2 and "rope_theta is a 5,000-digit number" in done.stderr, done.stderr


@pytest.mark.parametrize("field", sorted(FIELD_BOUNDS))
def test_every_bounded_field_just_outside_its_range_is_one_line_naming_it(field: str, tmp_path: Path) -> None:
    low, high = FIELD_BOUNDS[field]
    path = tmp_path / "absurd.json"
    runner = CliRunner()
    for value, shown in ((high + 1, f"{high + 1}"), ("12", "'12'"), (1.5e300, "1.5e+300")):
        path.write_text(json.dumps({**LLAMA, field: value}))
        result = runner.invoke(main, ["plan", "--model", str(path), "--gpu-memory", "80GiB"])
        assert result.exit_code == 2, (field, value, result.output)
        assert result.output == (f"error: model config 'absurd': {field} is {shown}; it must be a number from "
                                 f"{low:,} to {high:,}\n"), result.output
    if low > 0:
        path.write_text(json.dumps({**LLAMA, field: low - 1}))
        result = runner.invoke(main, ["plan", "--model", str(path), "--gpu-memory", "80GiB"])
        assert result.exit_code == 2 and f"{field} is {low - 1};" in result.output, result.output


def test_a_field_at_the_edge_of_its_range_still_plans(tmp_path: Path) -> None:
    path = tmp_path / "absurd.json"
    path.write_text(json.dumps({**LLAMA, "max_position_embeddings": 1 << 31, "num_hidden_layers": 64}))
    result = CliRunner().invoke(main, ["plan", "--model", str(path), "--gpu-memory", "80GiB", "--json"])
    assert result.exit_code in (0, 1), result.output
    assert json.loads(result.output)["model"] == "absurd"
