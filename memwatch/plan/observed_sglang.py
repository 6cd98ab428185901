"""Plan versus observed for a run SGLang sized: its token pool against SGLang's own rule on the plan's terms.

SGLang runs no forward before it sizes (:mod:`memwatch.sglang_rule`): it keeps ``1 − mem_fraction_static`` of
the memory that was free before the weights for activations and CUDA graphs, and gives the KV pool what is
free at sizing beyond that. So its terms are the weights, memory outside PyTorch, the allocator's cache
slack, that kept room, and the pool in tokens; the plan predicts each from the model config (weights from
the parameter count, memory outside PyTorch from :mod:`memwatch.plan.non_torch`) and applies SGLang's rule
to them, with the run's ``mem_fraction_static``, page size and ``max_total_tokens`` cap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memwatch import sglang_rule
from memwatch.plan.capacity import PlanError
from memwatch.plan.non_torch import non_torch_terms
from memwatch.units import format_bytes


def compare_sglang_rank(run: Mapping[str, Any], config: Mapping[str, Any], data: Mapping[str, Any],
                        rank: int) -> Any:
    """One rank's comparison (a :class:`memwatch.plan.observed.PlanVsObserved`)."""
    from memwatch.plan.observed import (
        PlanVsObserved,
        TermComparison,
        _dtype,
        _non_torch_term,
        _spec_for,
        _term,
        _weights_term,
        _within_tolerance,
    )

    missing = [key for key in ("total_bytes", "used_bytes", "current_bytes", "reserved_bytes", "num_blocks",
                               "block_bytes", *sglang_rule.INPUTS) if data.get(key) is None]
    if missing:
        raise PlanError(f"the run's kv_allocated event lacks {', '.join(missing)}; "
                        "it was recorded by an SGLang adapter that does not report SGLang's sizing")
    spec = _spec_for(run, config)
    dtype = _dtype(config.get("dtype"), spec.dtype)
    kv_dtype = _dtype(config.get("kv_cache_dtype"), dtype)
    tp = int(config.get("tensor_parallel_size") or 1)
    fraction, page = float(data["mem_fraction_static"]), int(data["page_size"])
    cap = data.get("max_total_tokens")
    total = int(data["total_bytes"])

    weights_p = spec.weight_bytes(dtype, tp)
    non_torch_p = sum(non_torch_terms(tp, engine="sglang").values())
    cell_p = spec.block_bytes(1, tp, kv_dtype)
    before_load_p = total - non_torch_p
    room_p = int(before_load_p * (1 - fraction))
    budget_p = sglang_rule.kv_budget_bytes((before_load_p - weights_p) / sglang_rule.GIB,
                                           before_load_p / sglang_rule.GIB, fraction)
    tokens_p = sglang_rule.pool_tokens(max(budget_p, 0), cell_p, page,
                                       max_total_tokens=None if cap is None else int(cap))

    current, used, reserved = int(data["current_bytes"]), int(data["used_bytes"]), int(data["reserved_bytes"])
    room_m = int(round(float(data["pre_model_load_gb"]) * sglang_rule.GIB) * (1 - fraction))
    cell_m, tokens_m = int(data["block_bytes"]), int(data["num_blocks"])
    terms = [
        _weights_term(weights_p, current, dtype),
        _non_torch_term("non-PyTorch", non_torch_p, used - reserved),
        _term("cache slack", 0, reserved - current,
              "the allocator held cached, unallocated memory when the pool was sized; SGLang counts it as used",
              "the allocator reported less reserved than allocated: inconsistent readings"),
        _term("kept for activations", room_p, room_m,
              "1 − mem_fraction_static of more free memory before the weights than planned: memory outside "
              "PyTorch was smaller when SGLang measured it",
              "1 − mem_fraction_static of less free memory before the weights than planned: memory outside "
              "PyTorch (or another process) had taken more when SGLang measured it"),
    ]
    kv_p, kv_m = tokens_p * cell_p, tokens_m * cell_m
    others = sum(term.diff_bytes for term in terms if term.term != "kept for activations")
    if cell_m != cell_p:
        kv_cause = (f"{cell_m:,} bytes a token instead of the planned {cell_p:,}: the KV dtype, the heads per "
                    "rank or a draft model's layers differ from the recorded config")
    elif _within_tolerance(kv_m - kv_p, kv_p):
        kv_cause = "as planned"
    else:
        kv_cause = (f"follows from the terms above: they take {format_bytes(others)} beyond the plan, and SGLang's "
                    "pool gets what is free at sizing beyond the kept room")
    terms.append(TermComparison("KV tokens", kv_p, kv_m, kv_m - kv_p, kv_cause, tokens_p, tokens_m))
    return PlanVsObserved(
        run_id=str(run.get("run_id", "")), rank=rank, model=spec.name, total_bytes=total, utilization=fraction,
        warmup_seqs=0, warmup_seq_len=0, predicted_block_bytes=cell_p, measured_block_bytes=cell_m,
        terms=tuple(terms),
    )
