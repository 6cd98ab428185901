"""SGLang 0.5.23's own scheduler loop under memwatch for hundreds of steps, with retractions forced: what memwatch
stored equals what SGLang's objects said at every step, and ``check`` names the budget SGLang's rule makes.

``sglang_driver.py serve-long`` runs SGLang's own ``event_loop_normal`` on a real ``Scheduler`` (its pools,
radix cache, policy, retraction and idle checks), the requests sent over ZeroMQ as SGLang's tokenizer manager
sends them, with a stand-in forward at ``TpModelWorker.forward_batch_generation`` (token 7 for every request);
it reports per batch SGLang's forward mode, requests, extend tokens, the allocator's available tokens, the
radix cache's evictable tokens and the requests it retracted.
"""

from __future__ import annotations

import json
from pathlib import Path

from sglang_runs import CONTEXT, QWEN3, QWEN3_CELL, WEIGHTS, GiB, MiB, drive, events, memwatch

from memwatch.ledger import Sizing
from memwatch.sglang_rule import kv_budget_bytes, pool_tokens

from processes import memwatch_env, query
from stored_runs import store_rings

SMALL = 160 * MiB  # 72 MiB free at sizing, 96 MiB before the weights


def test_two_hundred_scheduler_steps_with_retractions_are_stored_as_sglang_counted_them(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000201")
    facts = drive("serve-long", tmp_path, env, QWEN3, total=SMALL)
    store_rings(runtime_dir, db_path, live=True)
    steps = facts["steps"]
    # 72 MiB free less 73.6 % of 96 MiB: 1.344 MiB, 344 cells of 4 KiB (pages of one token). Twelve requests of
    # 30 to 85 tokens (690 in all) and 60 output tokens each cannot all keep their tokens in 344.
    total = pool_tokens(kv_budget_bytes((SMALL - CONTEXT - WEIGHTS) / GiB, (SMALL - CONTEXT) / GiB, 0.264),
                        QWEN3_CELL, 1)
    assert total == 344 == facts["max_total_num_tokens"]
    assert len(steps) >= 200

    # One sample per batch, in order: SGLang's kind, requests, tokens, and used = total − available − evictable.
    rows = query(db_path, "SELECT step, step_kind, num_seqs, num_tokens, kv_blocks_used, kv_blocks_total FROM samples "
                          "WHERE kv_blocks_total IS NOT NULL ORDER BY step")
    kinds = {"EXTEND": "prefill", "DECODE": "decode"}
    assert [row[1:] for row in rows] == [
        (kinds[s["mode"]], s["num_seqs"], s["extend_tokens"] if s["mode"] == "EXTEND" else s["num_seqs"],
         total - s["available"] - s["evictable"], total) for s in steps]
    sample_steps = [row[0] for row in rows]

    # The radix cache's evictable tokens, kept apart from the used ones: an event at each step where SGLang's
    # count changed, with SGLang's count and the allocator's available tokens at that step.
    changes, before = [], 0
    for step, s in zip(sample_steps, steps, strict=True):
        if s["evictable"] != before:
            changes.append((step, s["evictable"], s["available"]))
            before = s["evictable"]
    stored = query(db_path, "SELECT step, json_extract(data, '$.evictable_tokens'), "
                            "json_extract(data, '$.available_tokens') FROM events WHERE kind = 'kv_evictable' "
                            "ORDER BY rowid")
    assert stored == changes and len(changes) >= 5

    # Retractions: SGLang retracts while choosing a batch, after the previous batch's sample; one preemption event
    # each, with SGLang's count.
    retracted = [(sample_steps[i - 1], s["retracted"]) for i, s in enumerate(steps) if s["retracted"]]
    assert len(retracted) >= 3
    assert query(db_path, "SELECT step, json_extract(data, '$.count') FROM events WHERE kind = 'preemption' "
                          "ORDER BY rowid") == retracted

    # Requests counted once each: a retracted request that comes back is not a new arrival.
    arrived = [(d["request_id"], d["prompt_tokens"], d["max_tokens"]) for _, d in events(db_path, "request_arrived")]
    assert arrived == [(rid, length, 60) for rid, length in facts["prompts"].items()] and len(arrived) == 12
    finished = sorted((d["request_id"], d["output_tokens"]) for _, d in events(db_path, "request_finished"))
    assert finished == sorted((rid, 60) for rid in facts["prompts"])
    assert query(db_path, "SELECT status FROM runs") == [("ok",)]


def test_check_names_the_budget_sglangs_rule_makes(tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """SGLang's budget is what it committed at sizing, used + peak − current + the KV bytes it profiled: the line
    says so, and its number is those four readings of the kv_allocated event added up."""
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000202")
    drive("serve", tmp_path, env, QWEN3, total=SMALL)
    store_rings(runtime_dir, db_path)
    [(_, sizing)] = events(db_path, "kv_allocated")
    budget = sizing["used_bytes"] + sizing["peak_bytes"] - sizing["current_bytes"] + sizing["profiled_kv_bytes"]
    done = memwatch(env, "check", "5a1a00000202")
    assert done.returncode in (0, 1), done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.strip().startswith("budget (")]
    assert "budget (used + peak − current + the KV bytes SGLang profiled)" in line and f"{budget:,}" in line
    assert "total × utilization" not in done.stdout
    checked = json.loads(memwatch(env, "check", "5a1a00000202", "--json").stdout)
    assert checked["ranks"][0]["last_terms"]["budget_bytes"] == budget  # the JSON key and number are unchanged

    # The same words for each engine's rule: vLLM's budget adds the KV bytes it sized; nano-vllm's is its
    # total × utilization.
    def basis(rule: str | None, explicit: int | None) -> str:
        return Sizing(0, 0, None, 0.9, None, None, None, 1, 1, None, explicit, rule).budget_basis

    assert basis("vllm", 1) == "used + peak − current + the KV bytes vLLM sized"
    assert basis("sglang-hybrid-swa", 1) == "used + peak − current + the KV bytes SGLang profiled"
    assert basis("nano-vllm", None) == basis(None, None) == "total × utilization"
