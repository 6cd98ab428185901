"""``report --json``'s numbers, in process: the run's row, its shared quantities under the keys every command gives
them, each rank's summary row renamed to those keys with its end margin, and the explanation ``explain`` prints.

torch_leak: Qwen3-0.6B in bf16 on an 8 GiB device at utilization 0.6, sized by nano-vllm (113 blocks), leaking
inside PyTorch until a request of 2.5 MiB fails."""

from __future__ import annotations

from pathlib import Path

from memwatch.report import explain_run
from memwatch.report.facts import RankFacts
from memwatch.report.numbers import RENAMED, rank_numbers, report_numbers
from memwatch.store import open_store
from memwatch.store.run_figures import RankTruth, RunTruth

from processes import query
from stored_runs import store_scenario

MiB = 1 << 20
WEIGHTS = 2 * 596_049_920
KV = 113 * 2 * 28 * 256 * 8 * 128 * 2
CONTEXT = 512 * MiB
FACTS = ["rank", "status", "samples", "last_step", "weights_bytes", "torch_other_bytes", "activation_reserve_bytes",
         "non_torch_at_sizing_bytes", "num_blocks", "block_bytes", "kv_cache_bytes", "budget_bytes", "peak_used_bytes",
         "min_free_bytes", "serving_peak_bytes", "preemptions", "flag_counts", "oom_requested_bytes", "oom_step",
         "cuda_graphs_outside_budget_bytes", "oom_margin_bytes"]


def test_a_runs_numbers_are_its_row_its_shared_quantities_its_ranks_and_its_explanation(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db_path = tmp_path / "m.db"
    run_id = store_scenario("torch_leak", runtime, db_path, live=True)
    db = open_store(db_path, readonly=True)
    numbers = report_numbers(db, run_id[:8])
    [(oom_step,)] = query(db_path, "SELECT step FROM events WHERE kind = 'oom'")
    [(samples,)] = query(db_path, "SELECT count(*) FROM sample_rows")
    kinds = dict(query(db_path, "SELECT kind, count(*) FROM flags GROUP BY kind"))
    [rank] = numbers.pop("ranks")
    margin = numbers.pop("oom_margin_bytes")
    explanation = explain_run(db, run_id)
    assert numbers == {
        "run_id": run_id, "status": "oom", "engine": "nano-vllm", "model": "Qwen3-0.6B", "gpu": "Virtual GPU",
        "oom_step": oom_step, "non_torch_at_sizing_bytes": CONTEXT, "weights_bytes": WEIGHTS, "kv_cache_bytes": KV,
        "flag_counts": kinds, "worst_rank": 0, "outcome": "oom", "explanation": list(explanation.sentences)}
    # it ran out of memory: no margin was left at its end
    assert margin is not None and margin <= 0 and kinds == {"oom": 1, "oom_risk": 2, "torch_drift": 1}
    assert list(rank) == FACTS
    assert {key: rank[key] for key in ("rank", "samples", "non_torch_at_sizing_bytes", "kv_cache_bytes",
                                       "flag_counts", "oom_step", "oom_requested_bytes", "oom_margin_bytes")} == {
        "rank": 0, "samples": samples, "non_torch_at_sizing_bytes": CONTEXT, "kv_cache_bytes": KV,
        "flag_counts": kinds, "oom_step": oom_step, "oom_requested_bytes": 5 * MiB // 2, "oom_margin_bytes": margin}
    assert explanation.sentences[0].startswith(f"rank 0 ran out of memory at step {oom_step:,}: a request for 2.5 MiB")


def test_a_ranks_row_takes_the_shared_names_and_its_own_margin() -> None:
    facts = RankFacts(rank=1, status="ok", samples=3, last_step=2, weights_bytes=5, torch_other_bytes=None,
                      activation_reserve_bytes=None, non_pytorch_bytes=7, num_blocks=2, block_bytes=4, kv_bytes=8,
                      budget_bytes=None, peak_used_bytes=None, min_free_bytes=None, serving_peak_bytes=None,
                      preemptions=0, flags={"oom_risk": 1}, oom_requested_bytes=None, oom_step=None)
    truth = RunTruth("run", (RankTruth(0, None, None, 1, -5, 2, 3), RankTruth(1, None, None, 7, 9, 5, 8)))
    row = rank_numbers(facts, truth)
    assert list(row) == FACTS
    assert (row["non_torch_at_sizing_bytes"], row["kv_cache_bytes"], row["flag_counts"], row["oom_margin_bytes"]) == (
        7, 8, {"oom_risk": 1}, 9)
    assert rank_numbers(facts, RunTruth("run", (RankTruth(0, None, None, 1, -5, 2, 3),)))["oom_margin_bytes"] is None
    assert RENAMED == {"non_pytorch_bytes": "non_torch_at_sizing_bytes", "kv_bytes": "kv_cache_bytes",
                       "flags": "flag_counts"}
