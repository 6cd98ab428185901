"""The load each step carries, recorded by an adapter on the engine code people install.

nano-vllm-fork 20260210, vLLM 0.33.0 and 0.34.0 and SGLang 0.5.23 (``make engines``) run their real schedulers through
``released/*_driver.py``; no sidecar runs, so the rings stay in the runtime directory to be read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mirrors.zero_code import zero_code_env
from test_released_nanovllm import _generate
from test_released_sglang import CONTEXT, SMALL
from test_released_sglang import DRIVER as SGLANG_DRIVER
from test_released_sglang import ENGINE as SGLANG
from test_released_vllm import DRIVER, QWEN3, VLLM

from memwatch_engine.ring_format import sample_load
from memwatch_engine.ring_reader import RingReader

from processes import memwatch_env


def test_nano_vllm_records_each_steps_load_worked_out_by_hand(tmp_path: Path, runtime_dir: Path,
                                                              db_path: Path) -> None:
    tokens = _generate(tmp_path, zero_code_env(memwatch_env(runtime_dir, db_path), tmp_path))
    assert [len(t) for t in tokens] == [8, 8, 8]
    [ring] = runtime_dir.glob("*.ring")
    reader = RingReader(ring)
    drained = reader.drain(0)
    first = int.from_bytes(drained.slots[:8], "little")
    loads = [load for row in drained.samples if (load := sample_load(drained.slots, row[0] - first)) is not None]
    # The fork's schedule (worked out in test_released_nanovllm): the 300-token prompt alone, the other two
    # waiting; then the 350- and 40-token prompts, all three running; then 7 decodes of the three. Read during
    # the step, before the scheduler accounts its tokens. Blocks of 256 tokens: each request ends within the
    # blocks its prompt holds (300 -> 308 tokens: 2 blocks, 350 -> 358: 2, 40 -> 48: 1), so none needs more.
    assert loads == [(1, 2, 0), (3, 0, 0)] + [(3, 0, 0)] * 7
    reader.close()


def _drive_vllm(engine: Path, mode: str, tmp_path: Path, env: dict[str, str], *args: str) -> dict:
    """``released/vllm_driver.py`` as ``test_released_vllm`` runs it, on this checkout's memwatch as well."""
    model = tmp_path / "qwen3-tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3))
    path = ":".join(filter(None, (str(engine), os.environ.get("PYTHONPATH"))))
    env = {**env, "PYTHONPATH": path, "VLLM_TARGET_DEVICE": "cpu", "FAKE_CUDA_TOTAL_BYTES": str(160 << 20),
           "FAKE_CUDA_CONTEXT_BYTES": str(64 << 20)}
    env.pop("MEMWATCH", None)
    done = subprocess.run([sys.executable, str(DRIVER), mode, str(model), *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _loads(ring: Path) -> list[tuple[int, int, int]]:
    """The complete loads of a ring's samples, in order (a rank that records none has none)."""
    reader = RingReader(ring)
    drained = reader.drain(0)
    reader.close()
    first = int.from_bytes(drained.slots[:8], "little")
    return [load for row in drained.samples
            if (load := sample_load(drained.slots, row[0] - first)) is not None and min(load) >= 0]


@pytest.mark.parametrize("engine", [folder for _, folder in VLLM], ids=[version for version, _ in VLLM])
def test_vllm_s_scheduler_records_each_steps_load_worked_out_by_hand(engine: Path, tmp_path: Path, runtime_dir: Path,
                                                                    db_path: Path) -> None:
    facts = _drive_vllm(engine, "workload", tmp_path, memwatch_env(runtime_dir, db_path), "16")
    [loads] = [found for ring in runtime_dir.glob("*.ring") if (found := _loads(ring))]  # the scheduler's ring
    assert len(loads) == len(facts["steps"])
    # Requests of 40 + 10 i tokens, r_i arriving before step 4 i, each to 20 tokens, in blocks of 16 (128 blocks:
    # never short). Read after schedule(), before the step's token is added. Steps 1-4: r0 alone, holding 40 to 43
    # tokens (3 blocks) of the 60 it ends at (4): 1 more. Step 5: r1 joins with 50 tokens (4 blocks) of 70 (5):
    # 1 more, r0 at 44 still 1.
    assert loads[:5] == [(1, 0, 1)] * 4 + [(2, 0, 2)]
    assert loads[-1][1] == 0 and all(running <= 8 for running, _, _ in loads)


def test_sglang_s_scheduler_records_each_steps_load_worked_out_by_hand(tmp_path: Path, runtime_dir: Path,
                                                                      db_path: Path) -> None:
    model = tmp_path / "qwen3-tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3))
    env = {**memwatch_env(runtime_dir, db_path), "FAKE_CUDA_TOTAL_BYTES": str(SMALL),
           "PYTHONPATH": ":".join(filter(None, (str(SGLANG), os.environ.get("PYTHONPATH")))),
           "FAKE_CUDA_CONTEXT_BYTES": str(CONTEXT), "FAKE_CUDA_OTHER_BYTES": "0",
           "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python", "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "10"}
    env.pop("MEMWATCH", None)
    done = subprocess.run([sys.executable, str(SGLANG_DRIVER), "serve", str(model)], env=env, capture_output=True,
                          text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = json.loads(done.stdout.strip().splitlines()[-1])["steps"]
    [loads] = [found for ring in runtime_dir.glob("*.ring") if (found := _loads(ring))]
    assert len(loads) == len(steps)
    # Four 50-token prompts admitted in one prefill (test_released_sglang), none waiting; read after the batch
    # ran, before its tokens are accounted: each holds its 50 prompt tokens of the 50 + 80 it ends at, in a pool
    # of 1-token pages: 80 more each.
    assert loads[0] == (4, 0, 4 * 80)
    assert loads[-1][1] == 0 and all(running <= 4 for running, _, _ in loads)
