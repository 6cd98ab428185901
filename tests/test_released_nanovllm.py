"""The nano-vllm adapter against ``nano-vllm-fork`` 20260210 from PyPI (installed by ``make engines``), on CPU.

``released/nanovllm_driver.py`` runs the package's real ``LLM`` and ``ModelRunner`` with CUDA,
flash-attn and Triton replaced at their seams (described there). The same program runs with memwatch
off and with ``MEMWATCH=1`` through the real ``.pth`` line, into a real sidecar.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mirrors.zero_code import ROOT, zero_code_env

from processes import SidecarProcess, memwatch_env, query, wait_for

ENGINES = ROOT / ".engines"
DRIVER = Path(__file__).resolve().parent / "released" / "nanovllm_driver.py"
MiB = 1 << 20
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128,
    "vocab_size": 512, "max_position_embeddings": 1024, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
}
# 80 MiB device, 64 MiB of it the CUDA context: 16 MiB free.
DEVICE = {"FAKE_CUDA_TOTAL_BYTES": str(80 * MiB), "FAKE_CUDA_CONTEXT_BYTES": str(64 * MiB)}


def _generate(tmp_path: Path, env: dict[str, str]) -> list[list[int]]:
    for name in ("nanovllm", "vllm"):
        if not (ENGINES / name / ".installed").exists():
            pytest.fail(f"the released engines are not installed in {ENGINES}: run `make engines`")
    model = tmp_path / "qwen3-tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3))
    path = [ENGINES / "nanovllm", ENGINES / "vllm", *filter(None, env.get("PYTHONPATH", "").split(":"))]
    env = {**env, **DEVICE, "PYTHONPATH": ":".join(map(str, path))}
    done = subprocess.run([sys.executable, str(DRIVER), str(model)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "memwatch:" not in done.stderr, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fork_tokens_identical_on_and_off_and_its_own_sizing_rule(tmp_path: Path, runtime_dir: Path,
                                                                  db_path: Path) -> None:
    off = memwatch_env(runtime_dir, db_path)
    off.pop("MEMWATCH", None)
    tokens_off = _generate(tmp_path, off)
    assert not list(runtime_dir.glob("*.ring"))

    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sidecar.pause()
        tokens_on = _generate(tmp_path, zero_code_env(memwatch_env(runtime_dir, db_path), tmp_path))
        sidecar.resume()
        wait_for(lambda: query(db_path, "SELECT status FROM runs") == [("ok",)], timeout=60, what="the run")

    assert tokens_on == tokens_off
    assert [len(tokens) for tokens in tokens_on] == [8, 8, 8]
    assert query(db_path, "SELECT engine, rank_count FROM runs") == [("nano-vllm", 1)]

    # The fork's rule on its own inputs: block = 2 · 2 layers · 256 · 2 KV heads · 32 · 2 bytes = 128 KiB;
    # available = min(free 16 MiB × 0.9, total 80 MiB × 0.9 − current 0) → 15,099,494 // 131,072 = 115 blocks.
    [(data,)] = query(db_path, "SELECT data FROM events WHERE kind = 'kv_allocated'")
    sizing = json.loads(data)
    assert int(min(16 * MiB * 0.9, 80 * MiB * 0.9 - 0)) // 131072 == 115
    assert (sizing["budget_rule"], sizing["block_bytes"], sizing["num_blocks"]) == ("nano-vllm-fork", 131072, 115)
    assert (sizing["free_bytes"], sizing["total_bytes"], sizing["current_bytes"]) == (16 * MiB, 80 * MiB, 0)
    # Upstream's rule would give int(72 MiB − used 64 MiB − peak 0 + 0) // 128 KiB = 64: not this engine's.
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]

    # Steps, by hand from the fork's scheduler (512-token budget, no chunking, prefix blocks hashed as they
    # are allocated): the 300-token prompt alone (300 + 350 > 512); then the 350-token one, whose first
    # 256-token block is that prompt's, computes 94, with the 40-token prompt: 134 tokens; then 7 decodes.
    steps = query(db_path, "SELECT step_kind, num_seqs, num_tokens FROM samples "
                           "WHERE rank = 0 AND step_kind IS NOT NULL ORDER BY step")
    assert steps[:2] == [("prefill", 1, 300), ("prefill", 2, 134)]
