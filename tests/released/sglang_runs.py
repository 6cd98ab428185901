"""Run ``sglang_driver.py`` on a model config of the test's choosing and read back what memwatch stored.

The driver's process finds SGLang in ``.engines/sglang`` (``make engines``) and memwatch in this checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from processes import query

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / ".engines" / "sglang"
DRIVER = Path(__file__).resolve().parent / "sglang_driver.py"
MiB = 1 << 20
GiB = 1 << 30
TOTAL, CONTEXT, WEIGHTS = GiB, 64 * MiB, 24 * MiB  # the fake device, its CUDA context, the driver's weights
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 512,
    "vocab_size": 1024, "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}
QWEN3_CELL = 4 * 4 * (64 + 64) * 2
"""4 layers × 4 KV heads × (K 64 + V 64) × 2 bytes (bfloat16): 4 KiB a token."""


def drive(mode: str, tmp_path: Path, env: dict[str, str], config: dict[str, Any], total: int = TOTAL,
          **settings: str) -> dict[str, Any]:
    """The driver's JSON line for ``mode`` on a model with ``config``; ``settings`` are extra environment."""
    if not (ENGINE / ".installed").exists():
        pytest.fail(f"the released SGLang is not installed in {ENGINE}: run `make engines`")
    model = tmp_path / str(config["model_type"])
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    env = {**env, "PYTHONPATH": os.pathsep.join((str(ENGINE), str(ROOT))), "FAKE_CUDA_TOTAL_BYTES": str(total),
           "FAKE_CUDA_CONTEXT_BYTES": str(CONTEXT), "FAKE_CUDA_OTHER_BYTES": "0",
           # SGLang's Python radix tree (its Rust one allocates device tensors natively); admission that counts
           # 10 of a new request's output tokens, so that decoding outgrows the pool and SGLang retracts.
           "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python", "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "10",
           **settings}
    env.pop("MEMWATCH", None)
    done = subprocess.run([sys.executable, str(DRIVER), mode, str(model)], env=env, capture_output=True, text=True,
                          timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "memwatch:" not in done.stderr, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def events(db_path: Path, kind: str) -> list[tuple[int, dict[str, Any]]]:
    rows = query(db_path, "SELECT rank, data FROM events WHERE kind = ? ORDER BY rank, rowid", (kind,))
    return [(rank, json.loads(data)) for rank, data in rows]


def memwatch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """A ``memwatch`` command on the stored runs, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "memwatch", *args], env=env, capture_output=True, text=True,
                          timeout=120)
