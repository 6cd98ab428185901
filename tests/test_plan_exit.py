"""``memwatch plan`` exits 1 when the engine would refuse to start: a KV budget that holds no block.

The numbers are worked by hand from nano-vllm's rule, budget = int(total × util) − non-PyTorch − weights − activation,
with Qwen2.5-7B-Instruct's block of 256 tokens × 28 layers × 2 (K, V) × 4 KV heads × 128 × 2 bytes = 14,680,064 B.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main

GIB, MIB = 2**30, 2**20
BLOCK = 256 * 28 * 2 * 4 * 128 * 2
TERMS = ["--non-torch-bytes", "512MiB", "--activation-reserve-bytes", "2GiB"]


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def plan(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["plan", *args, *TERMS])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(("args", "kv_budget"), [
    # 1 KiB × 0.9 = 921 B, less 512 MiB, 15 GiB of weights and 2 GiB
    (["--gpu-memory", "1KiB", "--weights-bytes", "15GiB"], 921 - 512 * MIB - 15 * GIB - 2 * GIB),
    # int(24 GiB × 0.9) = 23,192,823,398 B, less 512 MiB, 100 GiB and 2 GiB
    (["--gpu-memory", "24GiB", "--weights-bytes", "100GiB"], 23_192_823_398 - 512 * MIB - 100 * GIB - 2 * GIB),
])
def test_no_room_for_a_block_exits_1_with_the_reason(args: list[str], kv_budget: int) -> None:
    code, out, err = plan(*args)
    assert (code, err) == (1, "")
    assert "no room for any KV cache" in out
    assert f"nano-vllm refuses to start: the KV budget ({kv_budget:,} B) holds no block" in " ".join(out.split())
    code, out, err = plan(*args, "--json")
    assert (code, err) == (1, "")                    # the JSON is printed all the same
    data = json.loads(out)
    assert (data["kv_blocks"], data["kv_budget_bytes"]) == (0, kv_budget)
    assert data["startup_error"].startswith("nano-vllm refuses to start")


def test_an_explicit_kv_size_under_one_block_exits_1() -> None:
    code, out, _ = plan("--kv-cache-memory-bytes", str(BLOCK - 1), "--json")
    assert code == 1
    assert json.loads(out)["kv_blocks"] == 0
    assert "a larger --kv-cache-memory-bytes" in json.loads(out)["startup_error"]
    code, out, _ = plan("--kv-cache-memory-bytes", str(BLOCK), "--json")  # exactly one block starts
    assert (code, json.loads(out)["kv_blocks"], json.loads(out)["startup_error"]) == (0, 1, None)


def test_a_plan_that_fits_exits_0() -> None:
    # 23,192,823,398 − 512 MiB − 15 GiB − 2 GiB = 4,402,341,478 B: 299 blocks of 14,680,064 B (4,389,339,136 B)
    code, out, err = plan("--gpu-memory", "24GiB", "--weights-bytes", "15GiB", "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert (data["kv_budget_bytes"], data["kv_blocks"], data["startup_error"]) == (4_402_341_478, 299, None)
