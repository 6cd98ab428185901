"""The report's summary row of each rank, from a stored run read through its one model: the sizing numbers follow
from the scenario (Qwen3-0.6B in bf16 on an 8 GiB device at utilization 0.6, sized by nano-vllm), the sample
aggregates are selected with SQL of the test's own; edge cases are ranks set by hand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from memwatch.flags import Flag
from memwatch.records import Event
from memwatch.report.facts import RankFacts, rank_facts, run_facts
from memwatch.report.run_data import Phase, Points, RankData, run_data_of
from memwatch.report.series import Series
from memwatch.store import open_store
from memwatch.store.run_model import load_run

from processes import query
from stored_runs import store_scenario

MiB = 1 << 20
GiB = 1 << 30
WEIGHTS = 2 * 596_049_920
"""Qwen3-0.6B's parameters in bf16: ``weights_loaded`` and ``current`` at sizing (nothing else long-lived yet)."""
BLOCK = 2 * 28 * 256 * 8 * 128 * 2
"""K and V × 28 layers × 256 tokens × 8 KV heads × head_dim 128 × 2 bytes."""
BLOCKS = 113
"""nano-vllm's rule: (8 GiB × 0.6 − used 1,732,247,552 − peak 1,293,370,880 + current) // BLOCK."""
CONTEXT = 512 * MiB
"""The simulated CUDA context: used − reserved at sizing."""


def _facts(tmp_path: Path, name: str) -> tuple[Path, RankFacts]:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db = tmp_path / "m.db"
    run_id = store_scenario(name, runtime, db, live=True)
    [facts] = run_facts(run_data_of(load_run(open_store(db, readonly=True), run_id)))
    return db, facts


def _from_samples(db: Path) -> dict[str, object]:
    [(samples, peak_used, min_free)] = query(db, "SELECT count(*), max(driver_used_bytes), min(driver_free_bytes) "
                                                 "FROM sample_rows")
    [(last_step,)] = query(db, "SELECT step FROM sample_rows ORDER BY ts_ns DESC, seq DESC LIMIT 1")
    [(serving_peak,)] = query(db, "SELECT max(peak_bytes) FROM sample_rows WHERE ts_ns >= (SELECT ts_ns FROM events "
                                  "WHERE kind = 'phase_start' AND json_extract(data, '$.phase') = 'serve')")
    return {"samples": samples, "last_step": last_step, "peak_used_bytes": peak_used, "min_free_bytes": min_free,
            "serving_peak_bytes": serving_peak}


SIZED = {"rank": 0, "weights_bytes": WEIGHTS, "torch_other_bytes": 0,
         "activation_reserve_bytes": 1_293_370_880 - WEIGHTS, "non_pytorch_bytes": CONTEXT, "num_blocks": BLOCKS,
         "block_bytes": BLOCK, "kv_bytes": BLOCKS * BLOCK, "budget_bytes": int(8 * GiB * 0.6)}


def test_a_run_under_kv_pressure_counts_its_preemptions_flags_and_graphs(tmp_path: Path) -> None:
    db, facts = _facts(tmp_path, "kv_pressure")
    [(preempted,)] = query(db, "SELECT sum(json_extract(data, '$.count')) FROM events WHERE kind = 'preemption'")
    [(flags,)] = query(db, "SELECT count(*) FROM flags WHERE kind = 'kv_pressure'")
    [(first_serving,)] = query(db, "SELECT allocated_bytes FROM sample_rows WHERE phase = 'serve' "
                                   "ORDER BY ts_ns, seq LIMIT 1")
    assert facts.to_dict() == {
        **SIZED, "status": "ok", **_from_samples(db), "preemptions": preempted, "flags": {"kv_pressure": flags},
        "oom_requested_bytes": None, "oom_step": None,
        # nano-vllm captures its graphs after sizing: the first serving sample holds them beyond weights and KV.
        "cuda_graphs_outside_budget_bytes": first_serving - WEIGHTS - BLOCKS * BLOCK}
    assert preempted > 17 and flags > 0 and facts.cuda_graphs_outside_budget_bytes == 324_841_472


def test_a_run_that_ran_out_of_memory_names_the_request_and_its_step(tmp_path: Path) -> None:
    db, facts = _facts(tmp_path, "torch_leak")
    [(oom_step,)] = query(db, "SELECT step FROM events WHERE kind = 'oom'")
    kinds = dict(query(db, "SELECT kind, count(*) FROM flags GROUP BY kind"))
    assert facts.to_dict() == {
        **SIZED, "status": "oom", **_from_samples(db), "preemptions": 0, "flags": kinds,
        # the last request, one leaked step's 2.5 MiB; the leak is the rise, so no graphs are named
        "oom_requested_bytes": 5 * MiB // 2, "oom_step": oom_step, "cuda_graphs_outside_budget_bytes": None}
    assert kinds == {"oom": 1, "oom_risk": 2, "torch_drift": 1}


def _rank(sizing: dict[str, object] | None = None, *, weights: int | None = None, series: Series | None = None,
          phases: tuple[Phase, ...] = (), events: tuple[Event, ...] = (), flags: tuple[Flag, ...] = ()) -> RankData:
    return RankData(rank=3, status=None, series=series or Series(), points=Points(), phases=list(phases),
                    flags=list(flags), ooms=[e for e in events if e.kind == "oom"],
                    preemptions=[e for e in events if e.kind == "preemption"], snapshot=[], sizing=sizing,
                    weights_bytes=weights, total_bytes=None)


def _event(kind: str, step: int, **data: object) -> Event:
    return Event("r", 3, step, step * 1000, kind, dict(data))


def test_a_rank_without_samples_or_sizing_has_only_its_counts() -> None:
    facts = rank_facts(_rank(weights=7 * GiB))
    assert facts == RankFacts(rank=3, status=None, samples=0, last_step=None, weights_bytes=7 * GiB,
                              torch_other_bytes=None, activation_reserve_bytes=None, non_pytorch_bytes=None,
                              num_blocks=None, block_bytes=None, kv_bytes=None, budget_bytes=None,
                              peak_used_bytes=None, min_free_bytes=None, serving_peak_bytes=None, preemptions=0,
                              flags={}, oom_requested_bytes=None, oom_step=None)


def test_weights_default_to_current_at_sizing_and_other_pytorch_is_never_negative() -> None:
    sizing = {"current_bytes": 10 * GiB, "peak_bytes": 13 * GiB, "used_bytes": 12 * GiB, "reserved_bytes": 11 * GiB}
    unloaded = rank_facts(_rank(sizing))
    assert (unloaded.weights_bytes, unloaded.torch_other_bytes, unloaded.activation_reserve_bytes,
            unloaded.non_pytorch_bytes, unloaded.kv_bytes, unloaded.budget_bytes) == (10 * GiB, 0, 3 * GiB, GiB,
                                                                                       None, None)
    assert rank_facts(_rank(sizing, weights=9 * GiB)).torch_other_bytes == GiB
    assert rank_facts(_rank(sizing, weights=11 * GiB)).torch_other_bytes == 0
    no_current = rank_facts(_rank({"peak_bytes": 13 * GiB, "total_bytes": 80 * GiB}, weights=9 * GiB))
    assert (no_current.weights_bytes, no_current.torch_other_bytes, no_current.activation_reserve_bytes,
            no_current.budget_bytes) == (9 * GiB, None, None, None)
    no_peak = rank_facts(_rank({"current_bytes": 10 * GiB, "gpu_memory_utilization": 0.5}))
    assert (no_peak.activation_reserve_bytes, no_peak.budget_bytes) == (None, None)
    assert rank_facts(_rank({"total_bytes": 80 * GiB, "gpu_memory_utilization": 0.9})).budget_bytes == 72 * GiB


def test_each_preemption_counts_its_requests_or_one_and_the_first_oom_is_named() -> None:
    events = (_event("preemption", 1, count=3), _event("preemption", 2), _event("preemption", 3, count=None),
              _event("preemption", 4, count=0), _event("oom", 9, requested_bytes="2 GiB"),
              _event("oom", 11, requested_bytes=GiB))
    flags = tuple(Flag("r", 3, step, step * 1000, kind, "warning", "", {})
                  for step, kind in ((1, "oom_risk"), (2, "torch_drift"), (5, "oom_risk")))
    facts = rank_facts(_rank(events=events, flags=flags))
    # 3 + 1 + 1 + 1; the first out-of-memory's request was not a number
    assert (facts.preemptions, facts.oom_step, facts.oom_requested_bytes, facts.flags) == (
        6, 9, None, {"oom_risk": 2, "torch_drift": 1})
    assert rank_facts(_rank(events=events[5:])).oom_requested_bytes == GiB


def test_the_extremes_skip_unknowns_and_the_serving_peak_is_the_stored_one() -> None:
    series = Series(first_ns=[100, 200, 300, 400], last_ns=[100, 200, 300, 400], first_step=[0, 1, 2, 3],
                    last_step=[0, 1, 2, 7], count=[1, 1, 1, 4], peak_max=[9 * GiB, 5 * GiB, None, 4 * GiB],
                    used_max=[None, 6 * GiB, 8 * GiB, 7 * GiB], free_min=[3 * GiB, None, GiB, 2 * GiB])
    data = dataclasses.replace(_rank(series=series, phases=(Phase("serve", 200, 400),)), serving_peak_bytes=5 * GiB)
    facts = rank_facts(data)
    assert (facts.samples, facts.last_step, facts.peak_used_bytes, facts.min_free_bytes, facts.serving_peak_bytes) \
        == (7, 7, 8 * GiB, GiB, 5 * GiB)
    assert rank_facts(_rank(series=series, phases=(Phase("serve", 200, 400),))).serving_peak_bytes is None

