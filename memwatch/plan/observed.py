"""Plan versus observed: the ledger a run's config predicts, against what its engine measured at KV sizing.

The engine sizes its KV cache with ``num_blocks = int(total × util − used − peak + current) // block_bytes``,
which splits the budget into four measured terms (see ``kv_allocated``)::

    weights            = current            (allocated when the cache is sized)
    activation reserve = peak − current     (the warmup forward's transient peak)
    non-PyTorch        = used − reserved    (CUDA context, workspaces, other processes)
    cache slack        = reserved − current (cached by the allocator, unallocated)
    KV blocks          = num_blocks

(the engine's own ``used − current`` is non-PyTorch plus cache slack; a run that did not record the
allocator's reserve at sizing shows the two as one line, "non-PyTorch + cache slack").

The plan predicts the same terms from the model config: weights from the parameter count, the
reserve from the activation model on the engine's warmup batch, memory outside PyTorch from the
estimate of :mod:`memwatch.plan.non_torch`, and the KV blocks left over. Each difference is
explained by the assumption it contradicts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from decimal import Decimal
from typing import Any

from memwatch.kv_sizing import is_startup_sizing
from memwatch.models.activation import forward_activation_bytes, warmup_batch
from memwatch.models.spec import ModelSpec, canonical_dtype
from memwatch.plan.capacity import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_UTILIZATION,
    PlanError,
)
from memwatch.plan.non_torch import non_torch_terms
from memwatch.units import MIB, format_bytes

TOLERANCE = 0.01
"""Differences within 1% of the prediction (or 1 MiB) count as "as planned"."""


@dataclass(frozen=True)
class TermComparison:
    """One ledger term: predicted and measured bytes, their difference and its cause."""

    term: str
    predicted_bytes: int
    measured_bytes: int
    diff_bytes: int
    """``measured − predicted``."""
    cause: str
    predicted_blocks: int | None = None
    measured_blocks: int | None = None


@dataclass(frozen=True)
class PlanVsObserved:
    """The comparison for one rank of one run."""

    run_id: str
    rank: int
    model: str
    total_bytes: int
    utilization: float
    warmup_seqs: int
    warmup_seq_len: int
    predicted_block_bytes: int
    measured_block_bytes: int
    terms: tuple[TermComparison, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _as_dict(value: Any, what: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str | bytes):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            raise PlanError(f"the run's {what} is not valid JSON") from None
        if isinstance(decoded, dict):
            return decoded
    if value is None:
        return {}
    raise PlanError(f"the run's {what} must be a JSON object")


def _within_tolerance(diff: int, predicted: int) -> bool:
    return abs(diff) <= max(abs(predicted) * TOLERANCE, MIB)


def _term(term: str, predicted: int, measured: int, over: str, under: str) -> TermComparison:
    diff = measured - predicted
    if _within_tolerance(diff, predicted):
        cause = "as planned"
    else:
        cause = over if diff > 0 else under
    return TermComparison(term, predicted, measured, diff, cause)


def _weights_term(predicted: int, measured: int, dtype: str) -> TermComparison:
    """The weights term, worded alike for every engine's rule."""
    return _term("weights", predicted, measured,
                 f"the engine holds more than parameters × {dtype}: extra buffers (rotary tables, "
                 "vocabulary padding) or tensors left over from loading",
                 f"the engine holds less than parameters × {dtype}: quantized weights, another dtype, "
                 "or a config that does not match the checkpoint")


def _non_torch_term(label: str, predicted: int, measured: int) -> TermComparison:
    """The memory outside PyTorch against the estimate of the CUDA context and NCCL buffers."""
    return _term(label, predicted, measured,
              "more than the estimate of the CUDA context and NCCL buffers: cuBLAS workspaces, graph "
              "pools or other processes on the GPU",
              "less than the estimate of the CUDA context and NCCL buffers: a smaller context "
              "(lazily loaded kernels), or readings not taken at the same moment")


def _spec_for(run: Mapping[str, Any], config: Mapping[str, Any]) -> ModelSpec:
    source = config.get("model_config") or run.get("model")
    if not source:
        raise PlanError("the run records neither a model_config nor a model; "
                        "plan it with memwatch plan --model instead")
    return ModelSpec.load(str(source))


def _dtype(value: Any, fallback: str) -> str:
    return fallback if value in (None, "", "auto") else canonical_dtype(str(value))


def compare_rank(run: Mapping[str, Any], kv_event: Mapping[str, Any]) -> PlanVsObserved:
    """Compare one rank's ``kv_allocated`` readings with the plan for the run's recorded config."""
    config = _as_dict(run.get("config"), "config")
    data = _as_dict(kv_event.get("data"), "kv_allocated event")
    if data.get("budget_rule") == "sglang":
        from memwatch.plan.observed_sglang import compare_sglang_rank

        return compare_sglang_rank(run, config, data, int(kv_event.get("rank") or 0))
    missing = [key for key in ("total_bytes", "used_bytes", "peak_bytes", "current_bytes",
                               "block_bytes", "num_blocks") if key not in data]
    if missing:
        raise PlanError(f"the run's kv_allocated event lacks {', '.join(missing)}; "
                        "it was recorded by an engine adapter that does not report KV sizing")
    spec = _spec_for(run, config)
    dtype = _dtype(config.get("dtype"), spec.dtype)
    kv_dtype = _dtype(config.get("kv_cache_dtype"), dtype)
    tp = int(config.get("tensor_parallel_size") or 1)
    block_size = int(config.get("block_size") or DEFAULT_BLOCK_SIZE)
    batched = int(config.get("max_num_batched_tokens") or DEFAULT_MAX_NUM_BATCHED_TOKENS)
    model_len = int(config.get("max_model_len") or batched)
    num_seqs, seq_len = warmup_batch(batched, model_len, int(config.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS))
    utilization = float(data.get("gpu_memory_utilization") or config.get("gpu_memory_utilization")
                        or DEFAULT_UTILIZATION)
    total = int(data["total_bytes"])

    weights_p = spec.weight_bytes(dtype, tp)
    non_torch_p = sum(non_torch_terms(tp, engine=str(run.get("engine") or "")).values())
    reserve_p = forward_activation_bytes(spec, num_seqs * seq_len, num_seqs, prefill=True, tp=tp)
    block_p = spec.block_bytes(block_size, tp, kv_dtype)
    explicit_kv = config.get("kv_cache_memory_bytes")
    if explicit_kv:
        kv_budget_p = int(explicit_kv)
    else:
        kv_budget_p = int(Decimal(total) * Decimal(str(utilization))) - non_torch_p - weights_p - reserve_p
    blocks_p = max(0, kv_budget_p) // block_p

    current, peak, used = int(data["current_bytes"]), int(data["peak_bytes"]), int(data["used_bytes"])
    reserved = data.get("reserved_bytes")
    outside = used - (current if reserved is None else int(reserved))
    block_m, blocks_m = int(data["block_bytes"]), int(data["num_blocks"])
    terms = [
        _weights_term(weights_p, current, dtype),
        _term("activation reserve", reserve_p, peak - current,
              "the warmup peak exceeds the activation model: a load-time spike kept because the peak "
              "was not reset before warmup, eager attention scores, or workspaces the model omits",
              f"the warmup peak is below the model of a {num_seqs} × {seq_len:,}-token prefill: warmup "
              "ran a smaller batch or a decode step, so a real long prefill can run out of memory"),
        _non_torch_term("non-PyTorch" if reserved is not None else "non-PyTorch + cache slack", non_torch_p, outside),
    ]
    if reserved is not None:
        terms.append(_term("cache slack", 0, int(reserved) - current,
                           "the allocator held cached, unallocated memory when the cache was sized (segment "
                           "rounding, or no empty_cache before sizing); the engine counts it as used",
                           "the allocator reported less reserved than allocated: inconsistent readings"))
    kv_p, kv_m = blocks_p * block_p, blocks_m * block_m
    others = sum(term.diff_bytes for term in terms)
    if block_m != block_p:
        kv_cause = (f"blocks of {block_m:,} bytes instead of the planned {block_p:,}: block_size or the KV "
                    "dtype differs from the recorded config")
    elif _within_tolerance(kv_m - kv_p, kv_p):
        kv_cause = "as planned"
    elif explicit_kv:
        kv_cause = "kv_cache_memory_bytes fixes the KV size; the engine sized it differently"
    else:
        kv_cause = (f"follows from the terms above: they take {format_bytes(others)} beyond the plan, "
                    "and every such byte comes out of the KV cache")
    terms.append(TermComparison("KV blocks", kv_p, kv_m, kv_m - kv_p, kv_cause, blocks_p, blocks_m))
    return PlanVsObserved(
        run_id=str(run.get("run_id", "")), rank=int(kv_event.get("rank") or 0), model=spec.name,
        total_bytes=total, utilization=utilization, warmup_seqs=num_seqs, warmup_seq_len=seq_len,
        predicted_block_bytes=block_p, measured_block_bytes=block_m, terms=tuple(terms),
    )


def compare_run(run: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> list[PlanVsObserved]:
    """One comparison per rank that recorded a ``kv_allocated`` event: the last startup sizing of each rank (a plan
    models the engine's start; a resize after CUDA-graph capture is compared by ``check``, not here)."""
    latest: dict[int, Mapping[str, Any]] = {}
    for event in events:
        if event.get("kind") == "kv_allocated" and is_startup_sizing(event.get("data")):
            latest[int(event.get("rank") or 0)] = event
    if not latest:
        raise PlanError(f"run {run.get('run_id')!r} has no kv_allocated event: the engine never sized "
                        "its KV cache, so there is nothing to compare with the plan")
    return [compare_rank(run, latest[rank]) for rank in sorted(latest)]
