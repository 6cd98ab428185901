"""The nano-vllm adapter under zero-code activation: TP 2 with a spawned worker, into a real sidecar.

The engine is ``tests/mirrors/nanovllm``, which mirrors GeeeekExplorer/nano-vllm at commit
``bb823b3e06983d71485a8e1f23715ebd87d98ef8`` (2026-04-26): ``nanovllm/engine/llm_engine.py``
(``LLMEngine.__init__`` spawns ``ModelRunner(config, i, event)`` for ranks 1.., ``step``, ``exit``),
``nanovllm/engine/model_runner.py`` (``__init__`` order: process group, ``set_device``, model
construction, ``load_model``, ``warmup_model``, ``allocate_kv_cache`` and its formula,
``capture_cudagraph``, shared-memory ``call``/``loop``/``exit``), ``nanovllm/engine/scheduler.py``
(``schedule``, ``preempt`` of ``running.pop()``), ``nanovllm/engine/block_manager.py``
(``blocks``, ``used_block_ids``, ``can_append``/``may_append``) and ``nanovllm/config.py``.
Each process runs on ``fake_cuda``'s simulated device; the engine runs as a real program with
``MEMWATCH=1`` through the real ``.pth`` line.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from mirrors.zero_code import zero_code_env

from processes import SidecarProcess, memwatch_env, query, wait_for

MiB = 1 << 20
MODEL_CONFIG = {
    "hidden_size": 512, "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 1024, "vocab_size": 2048, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
ENGINE = """
import sys
{prelude}
from nanovllm import LLM, SamplingParams

if __name__ == "__main__":
    {activate}
    llm = LLM(sys.argv[1], tensor_parallel_size={tp}, max_num_batched_tokens=2048, max_model_len=1024,
              max_num_seqs=16)
    outputs = llm.generate([[1] * 500, [2] * 500, [3] * 500], SamplingParams(max_tokens=20))
    print([len(output["token_ids"]) for output in outputs])
"""
# Both ranks: 160 MiB devices, 64 MiB of CUDA context; rank 1's device also holds 8 MiB of another process.
DEVICE = {"FAKE_CUDA_TOTAL_BYTES": str(160 * MiB), "FAKE_CUDA_CONTEXT_BYTES": str(64 * MiB),
          "FAKE_CUDA_OTHER_BYTES": f"0,{8 * MiB}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "Qwen3-mini"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return model


def _run_engine(tmp_path: Path, env: dict[str, str], tp: int, prelude: str = "", activate: str = "pass") -> str:
    script = tmp_path / "serve.py"
    script.write_text(ENGINE.format(tp=tp, prelude=prelude, activate=activate))
    done = subprocess.run([sys.executable, str(script), str(_model_dir(tmp_path))], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "memwatch:" not in done.stderr, done.stderr
    return done.stdout


def _events(db_path: Path, kind: str) -> list[tuple[int, dict]]:
    rows = query(db_path, "SELECT rank, data FROM events WHERE kind = ? ORDER BY rank, rowid", (kind,))
    return [(rank, json.loads(data)) for rank, data in rows]


def test_tp2_every_rank_records_and_the_sidecar_drains_both_rings(tmp_path: Path, runtime_dir: Path,
                                                                  db_path: Path) -> None:
    env = zero_code_env(memwatch_env(runtime_dir, db_path), tmp_path, NANOVLLM_MIRROR_PORT=str(_free_port()),
                        **DEVICE)
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        # Paused while the engine runs: a ring listed in the instant between its creation and its
        # header being written is ignored for good, and that race is not what this test is about.
        sidecar.pause()
        assert _run_engine(tmp_path, env, tp=2).strip() == "[20, 20, 20]"
        sidecar.resume()
        wait_for(lambda: query(db_path, "SELECT status FROM runs") == [("ok",)], what="the run to be stored")
        wait_for(lambda: not list(runtime_dir.glob("*.ring")), what="both rings to be drained and removed")

    [(run_id, rank_count, engine, model)] = query(db_path, "SELECT run_id, rank_count, engine, model FROM runs")
    assert (rank_count, engine, model) == (2, "nano-vllm", "Qwen3-mini")
    assert query(db_path, "SELECT rank, status FROM ranks ORDER BY rank") == [(0, "ok"), (1, "ok")]

    # Weights per rank: (2·vocab·hidden + layers·(4·hidden² + 3·hidden·intermediate)) · 2 bytes // tp
    weights = (2 * 2048 * 512 + 16 * (4 * 512 * 512 + 3 * 512 * 1024)) * 2 // 2
    assert weights == 44_040_192
    assert [(rank, data["weights_bytes"]) for rank, data in _events(db_path, "weights_loaded")] == [
        (0, weights), (1, weights)]

    # The engine's own formula on each rank's readings at sizing time:
    #   block_bytes = 2 · layers 16 · block 256 · (4 KV heads // tp 2) · head_dim 128 · 2 bytes = 4 MiB
    #   warmup: 2 sequences × 1024 tokens → activations 2048 · 512 · 2 · 4 = 8 MiB → peak = weights + 8 MiB
    #   used = 64 MiB context + weights (42 MiB segment) [+ 8 MiB other process on rank 1]
    #   blocks = int(160 MiB · 0.9 − used − peak + current) // 4 MiB → rank 0: 30 MiB // 4 MiB = 7, rank 1: 22 MiB → 5
    block_bytes = 2 * 16 * 256 * (4 // 2) * 128 * 2
    total = 160 * MiB
    sizing = _events(db_path, "kv_allocated")
    for (rank, data), other, blocks in zip(sizing, (0, 8 * MiB), (7, 5), strict=True):
        used = 64 * MiB + weights + other
        peak = weights + 2048 * 512 * 2 * 4
        assert int(total * 0.9 - used - peak + weights) // block_bytes == blocks
        assert data == {
            "total_bytes": total, "gpu_memory_utilization": 0.9, "used_bytes": used, "peak_bytes": peak,
            "current_bytes": weights, "block_bytes": block_bytes, "num_blocks": blocks, "block_size": 256,
            "reserved_bytes": weights,  # warmup's segments were emptied: only the weights' 42 MiB stay reserved
            "num_hidden_layers": 16, "num_kv_heads": 2, "head_dim": 128, "dtype_bytes": 2,
            "tensor_parallel_size": 2, "free_bytes": total - used, "budget_rule": "nano-vllm",
        }, rank
    mismatch = query(db_path, "SELECT data FROM flags WHERE kind = 'block_count_mismatch'")
    assert any(json.loads(data).get("num_blocks_by_rank") == {"0": 7, "1": 5} for (data,) in mismatch), mismatch

    # Steps (worked by hand from the scheduler): one prefill of the three 500-token prompts (6 of 7 blocks),
    # 12 decode steps to length 512, then at 513 each sequence needs a third block: A takes the last one,
    # B preempts C (the newest). A and B decode 7 more to length 520 (20 tokens) and finish; C re-prefills
    # its 513 tokens (3 blocks) less its first block, still in the prefix cache (a freed block keeps its
    # hash; the second was not complete when C was preempted): 257 tokens; then it decodes 6 more.
    # 1 + 19 + 1 + 6 = 27 steps on every rank.
    for rank in (0, 1):
        steps = query(db_path, "SELECT step, step_kind, num_seqs, num_tokens FROM samples "
                               "WHERE rank = ? AND step_kind IS NOT NULL ORDER BY step", (rank,))
        assert len(steps) == 27
        assert [row for row in steps if row[1] == "prefill"] == [(1, "prefill", 3, 1500), (21, "prefill", 1, 257)]
        assert {row[2] for row in steps[1:13]} == {3} and {row[2] for row in steps[13:20]} == {2}
    kv = query(db_path, "SELECT step, kv_blocks_used, kv_blocks_total FROM samples "
                        "WHERE rank = 0 AND step_kind IS NOT NULL ORDER BY step")
    assert kv[0] == (1, 6, 7) and kv[20] == (21, 3, 7) and {total for _, _, total in kv} == {7}
    assert query(db_path, "SELECT DISTINCT kv_blocks_used FROM samples WHERE rank = 1") == [(None,)]
    assert _events(db_path, "preemption") == [(0, {"count": 1})]
    assert query(db_path, "SELECT step FROM events WHERE kind = 'preemption'") == [(13,)]

    phases = [data["phase"] for rank, data in _events(db_path, "phase_start") if rank == 1]
    assert phases == ["load", "warmup", "kv_alloc", "cudagraph", "serve"]
    assert len({run for (run,) in query(db_path, "SELECT DISTINCT run_id FROM samples")}) == 1 == len([run_id])


def test_install_after_nanovllm_was_imported_patches_it_in_place(tmp_path: Path, runtime_dir: Path,
                                                                   db_path: Path) -> None:
    from memwatch.records import Event
    from memwatch.ring_records import read_ring

    device = {**DEVICE, "FAKE_CUDA_TOTAL_BYTES": str(256 * MiB)}
    env = zero_code_env(memwatch_env(runtime_dir, db_path), tmp_path, NANOVLLM_MIRROR_PORT=str(_free_port()),
                        **device)
    del env["MEMWATCH"]  # no zero-code activation: the program calls install() itself, late
    _run_engine(tmp_path, env, tp=1, prelude="import nanovllm.engine.model_runner",
                activate="import memwatch_engine.activate as a; assert a.install()")
    [ring] = runtime_dir.glob("*-r0.ring")
    events = [record for record in read_ring(ring) if isinstance(record, Event)]
    [sizing] = [event.data for event in events if event.kind == "kv_allocated"]
    # tp 1: block_bytes = 2 · 16 · 256 · 4 · 128 · 2 = 8 MiB; weights = 84 MiB; warmup activations 8 MiB
    #   blocks = int(256 MiB · 0.9 − (64 + 84) MiB − 8 MiB) // 8 MiB = 74.4 MiB // 8 MiB = 9
    assert (sizing["block_bytes"], sizing["num_blocks"], sizing["current_bytes"]) == (8 * MiB, 9, 84 * MiB)
    assert int(256 * MiB * 0.9 - (64 + 84) * MiB - 8 * MiB) // (8 * MiB) == 9
    assert [event.kind for event in events if event.kind == "phase_start" or event.kind == "run_end"] == [
        "phase_start"] * 5 + ["run_end"]
    assert events[-1].data == {"status": "ok"}


CHUNKED = """
import sys
from nanovllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=1, max_num_batched_tokens=512, max_model_len=1024, max_num_seqs=16)
    prompt = list(range(1, 1001))
    print([len(o["token_ids"]) for o in llm.generate([prompt], SamplingParams(max_tokens=2))])
    print([len(o["token_ids"]) for o in llm.generate([prompt + [7] * 100, [5] * 600], SamplingParams(max_tokens=2))])
"""


def test_chunked_prefill_and_prefix_cache_hits_record_the_tokens_computed(tmp_path: Path, runtime_dir: Path,
                                                                           db_path: Path) -> None:
    env = zero_code_env(memwatch_env(runtime_dir, db_path), tmp_path, NANOVLLM_MIRROR_PORT=str(_free_port()),
                        **{**DEVICE, "FAKE_CUDA_TOTAL_BYTES": str(256 * MiB)})
    script = tmp_path / "serve.py"
    script.write_text(CHUNKED)
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sidecar.pause()
        done = subprocess.run([sys.executable, str(script), str(_model_dir(tmp_path))], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and "memwatch:" not in done.stderr, done.stderr
        assert done.stdout.split() == ["[2]", "[2,", "2]"]
        sidecar.resume()
        wait_for(lambda: query(db_path, "SELECT status FROM runs") == [("ok",)], what="the run to be stored")

    # By hand (block 256, 512 tokens per step; only a step's first sequence may be cut): the 1000-token
    # prompt is computed as 512 + 488, then decodes its second token. Next, "prompt + 100" finds its 3
    # full leading blocks cached (768 tokens; a freed block keeps its hash) and computes 332; the
    # 600-token prompt does not fit the 180 left, so it goes next, cut into 512 + 88; then both decode.
    steps = query(db_path, "SELECT step_kind, num_seqs, num_tokens FROM samples "
                           "WHERE rank = 0 AND step_kind IS NOT NULL ORDER BY step")
    assert steps == [("prefill", 1, 512), ("prefill", 1, 488), ("decode", 1, 1), ("prefill", 1, 332),
                     ("prefill", 1, 512), ("prefill", 1, 88), ("decode", 2, 2)]
