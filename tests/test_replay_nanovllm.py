"""Replay of a nano-vllm run: request events recorded from the engine's own scheduler, then replayed.

The engine is the mirror in ``tests/mirrors/nanovllm`` on ``fake_cuda``'s simulated 256 MiB device
(64 MiB of context), TP 1, under zero-code activation, as the adapter tests run it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from mirrors.zero_code import zero_code_env

from processes import memwatch_env, query
from stored_runs import store_rings

MiB = 1 << 20
MODEL_CONFIG = {
    "hidden_size": 512, "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 1024, "vocab_size": 2048, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
ENGINE = """
import sys
from nanovllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=1, max_num_batched_tokens=2048, max_model_len=1024, max_num_seqs=16)
    outputs = llm.generate([[1] * 500, [2] * 500, [3] * 500], SamplingParams(max_tokens=20))
    print([len(output["token_ids"]) for output in outputs])
"""
DEVICE = {"FAKE_CUDA_TOTAL_BYTES": str(256 * MiB), "FAKE_CUDA_CONTEXT_BYTES": str(64 * MiB)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_requests_recorded_from_the_scheduler_replay_at_another_utilization(tmp_path: Path, runtime_dir: Path,
                                                                            db_path: Path) -> None:
    model = tmp_path / "Qwen3-mini"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    script = tmp_path / "serve.py"
    script.write_text(ENGINE)
    env = zero_code_env(memwatch_env(runtime_dir, db_path), tmp_path, NANOVLLM_MIRROR_PORT=str(_free_port()),
                        **DEVICE)
    done = subprocess.run([sys.executable, str(script), str(model)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[20, 20, 20]", done.stderr
    store_rings(runtime_dir, db_path)
    [(run_id,)] = query(db_path, "SELECT run_id FROM runs")

    rows = query(db_path, "SELECT rank, kind, data FROM events WHERE kind LIKE 'request_%' ORDER BY rowid")
    arrived = [json.loads(data) for rank, kind, data in rows if kind == "request_arrived" and rank == 0]
    finished = [json.loads(data) for rank, kind, data in rows if kind == "request_finished" and rank == 0]
    assert [(a["prompt_tokens"], a["max_tokens"]) for a in arrived] == [(500, 20)] * 3
    assert sorted(f["request_id"] for f in finished) == sorted(a["request_id"] for a in arrived)
    assert {f["output_tokens"] for f in finished} == {20}
    assert len(rows) == 6  # one event per arrival and per finish, none per token

    # At its own settings the replay sizes the same 9 blocks (worked out in the adapter tests) and, like the
    # engine, never preempts: three sequences of at most 520 tokens need 3 blocks each.
    replay_env = memwatch_env(runtime_dir, db_path)
    same = json.loads(_memwatch(replay_env, "replay", run_id, "--json"))
    assert (same["original"]["kv_blocks"], same["replay"]["kv_blocks"]) == (9, 9)
    assert same["original"]["preemptions"] == same["replay"]["preemptions"] == 0
    assert same["replay"]["oom"] is False and same["replay"]["max_concurrent_seqs"] == 3

    # At 0.8: int(256 MiB · 0.8 − (64 + 84) MiB − 8 MiB) // 8 MiB = 48.8 MiB // 8 MiB = 6 blocks. The three
    # 500-token prompts take 2 blocks each; at token 513 the first sequence needs a third and none is free,
    # so the newest is preempted; the other two finish and it is prefilled again: one preemption.
    lower = json.loads(_memwatch(replay_env, "replay", run_id, "--utilization", "0.8", "--json"))
    assert int(256 * MiB * 0.8 - (64 + 84) * MiB - 8 * MiB) // (8 * MiB) == 6
    assert lower["replay"]["kv_blocks"] == 6
    assert lower["replay"]["preemptions"] == 1 and lower["replay"]["oom"] is False


def _memwatch(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "memwatch", *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout
