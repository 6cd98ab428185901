"""Capacity planning per rank: how much KV cache fits, and whether a target load does.

The ledger of one rank, planned in exact bytes::

    budget      = gpu_memory × utilization                (or kv_cache_memory_bytes, which replaces it)
    KV budget   = budget − weights − non-KV peak
    KV blocks   = KV budget // block_bytes
    fits        = blocks the target needs <= KV blocks

A sequence of ``L`` tokens needs ``ceil(L / block_size)`` blocks of its full-attention layers and
``ceil(min(L, window) / block_size)`` of its sliding layers; the unrounded ("ideal") bytes are shown
beside the rounded ones. The shortfall is what the KV budget lacks for the target, so a plan 2.4 GiB
short needs 2.4 GiB more budget, never counted twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

from memwatch.errors import UsageError
from memwatch.models.activation import forward_activation_bytes, warmup_batch
from memwatch.models.spec import ModelSpec, canonical_dtype

DEFAULT_BLOCK_SIZE = 256
DEFAULT_UTILIZATION = 0.9
DEFAULT_MAX_NUM_BATCHED_TOKENS = 16_384
DEFAULT_MAX_NUM_SEQS = 512


class PlanError(UsageError):
    """Plan inputs that contradict each other or cannot describe a deployment."""


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclass(frozen=True)
class PlanInputs:
    """What the user states about one rank; ``None`` means "derive it from the model"."""

    gpu_memory_bytes: int | None = None
    utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    weights_bytes: int | None = None
    non_kv_bytes: int | None = None
    dtype: str | None = None
    kv_dtype: str | None = None
    tp: int = 1
    pp: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    seqs: int | None = None
    seq_len: int | None = None
    tokens: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS


@dataclass(frozen=True)
class LoadRow:
    """One line of the "resident sequences → KV bytes → fits?" table."""

    seqs: int
    kv_bytes: int
    ideal_kv_bytes: int
    fits: bool


@dataclass(frozen=True)
class CapacityPlan:
    """Every number of a plan; :meth:`to_dict` gives them under stable keys."""

    model: str
    attention_kind: str
    tp: int
    pp: int
    dtype: str
    kv_dtype: str
    block_size: int
    budget_mode: str
    """``utilization`` or ``kv_cache_memory_bytes``."""
    gpu_memory_bytes: int | None
    utilization: float | None
    budget_bytes: int | None
    weights_bytes: int
    weights_estimated: bool
    non_kv_bytes: int
    non_kv_estimated: bool
    kv_bytes_per_token: int
    block_bytes: int
    kv_budget_bytes: int
    kv_blocks: int
    ideal_kv_blocks: float
    max_resident_tokens: int
    ideal_max_resident_tokens: int
    seq_len: int | None
    seqs: int | None
    tokens: int | None
    seq_kv_bytes: int | None
    ideal_seq_kv_bytes: int | None
    max_concurrent_seqs: int | None
    ideal_max_concurrent_seqs: int | None
    required_kv_bytes: int | None
    ideal_required_kv_bytes: int | None
    fits: bool | None
    shortfall_bytes: int | None
    table: tuple[LoadRow, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["table"] = [asdict(row) for row in self.table]
        return data


def _check_inputs(inputs: PlanInputs) -> None:
    if inputs.utilization is not None and inputs.kv_cache_memory_bytes is not None:
        raise PlanError("--utilization and --kv-cache-memory-bytes are mutually exclusive: the explicit "
                        "KV size replaces the utilization budget; pass one of them")
    if inputs.kv_cache_memory_bytes is None and inputs.gpu_memory_bytes is None:
        raise PlanError("the plan needs --gpu-memory (the device's total bytes, e.g. 24GiB or "
                        "25769803776) or an explicit --kv-cache-memory-bytes")
    if inputs.utilization is not None and not 0 < inputs.utilization <= 1:
        raise PlanError(f"utilization must be in (0, 1], got {inputs.utilization}")
    if inputs.block_size < 1:
        raise PlanError(f"block size must be at least 1 token, got {inputs.block_size}")
    if inputs.tokens is not None and (inputs.seqs is not None or inputs.seq_len is not None):
        raise PlanError("give the target as --seqs N --seq-len L or as --tokens T, not both")
    if inputs.seqs is not None and inputs.seq_len is None:
        raise PlanError("--seqs needs --seq-len, the cached tokens of each sequence")
    for name in ("seqs", "seq_len", "tokens"):
        value = getattr(inputs, name)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _sequence_kv_bytes(spec: ModelSpec, inputs: PlanInputs, kv_dtype: str, seq_len: int) -> tuple[int, int]:
    """(block-rounded, ideal) KV bytes of one sequence on the busiest pipeline rank."""
    window = spec.sliding_window or seq_len
    block = inputs.block_size
    rounded, ideal = 0, 0
    for rank in range(inputs.pp):
        full, sliding = spec.kv_bytes_per_token_split(inputs.tp, inputs.pp, kv_dtype, rank)
        kept = min(seq_len, window)
        rounded = max(rounded, full * block * _ceil_div(seq_len, block)
                      + sliding * block * _ceil_div(kept, block))
        ideal = max(ideal, full * seq_len + sliding * kept)
    return rounded, ideal


def _table_sizes(target: int, max_concurrent: int) -> list[int]:
    """Rows of the load table: the first few counts, the last that fits, the first that does not,
    and the target itself."""
    sizes = set(range(1, min(target, 8) + 1)) | {target, max_concurrent + 1}
    if max_concurrent:
        sizes.add(max_concurrent)
    return sorted(sizes)


def estimate_non_kv_bytes(spec: ModelSpec, tp: int, max_num_batched_tokens: int,
                          max_model_len: int | None) -> int:
    """The activation peak of the engine's warmup prefill, the simulator's non-KV default."""
    model_len = max_model_len or max_num_batched_tokens
    num_seqs, seq_len = warmup_batch(max_num_batched_tokens, model_len, DEFAULT_MAX_NUM_SEQS)
    return forward_activation_bytes(spec, num_seqs * seq_len, num_seqs, prefill=True, tp=tp)


def plan_capacity(spec: ModelSpec, inputs: PlanInputs) -> CapacityPlan:
    """Work out one rank's KV budget and whether the target load fits in it."""
    _check_inputs(inputs)
    dtype = canonical_dtype(inputs.dtype or spec.dtype)
    kv_dtype = canonical_dtype(inputs.kv_dtype or spec.dtype)
    tp, pp, block = inputs.tp, inputs.pp, inputs.block_size
    per_token = spec.kv_bytes_per_token(tp, pp, kv_dtype)
    block_bytes = spec.block_bytes(block, tp, kv_dtype, pp)

    weights = inputs.weights_bytes
    if weights is None:
        weights = spec.weight_bytes(dtype, tp, pp)
    non_kv = inputs.non_kv_bytes
    if non_kv is None:
        non_kv = estimate_non_kv_bytes(spec, tp, inputs.max_num_batched_tokens, inputs.seq_len)

    if inputs.kv_cache_memory_bytes is not None:
        mode, utilization, budget = "kv_cache_memory_bytes", None, None
        kv_budget = inputs.kv_cache_memory_bytes
    else:
        mode = "utilization"
        utilization = DEFAULT_UTILIZATION if inputs.utilization is None else inputs.utilization
        budget = int(Decimal(inputs.gpu_memory_bytes or 0) * Decimal(str(utilization)))
        kv_budget = budget - weights - non_kv
    kv_blocks = max(0, kv_budget) // block_bytes
    pool = kv_blocks * block_bytes

    seq_kv = ideal_seq_kv = max_concurrent = ideal_concurrent = None
    required = ideal_required = fits = shortfall = None
    table: tuple[LoadRow, ...] = ()
    if inputs.seq_len is not None:
        seq_kv, ideal_seq_kv = _sequence_kv_bytes(spec, inputs, kv_dtype, inputs.seq_len)
        max_concurrent = pool // seq_kv
        ideal_concurrent = max(0, kv_budget) // ideal_seq_kv
    if inputs.seqs is not None and seq_kv is not None and ideal_seq_kv is not None:
        required, ideal_required = inputs.seqs * seq_kv, inputs.seqs * ideal_seq_kv
        table = tuple(LoadRow(n, n * seq_kv, n * ideal_seq_kv, n * seq_kv <= pool)
                      for n in _table_sizes(inputs.seqs, max_concurrent or 0))
    elif inputs.tokens is not None:
        required = _ceil_div(inputs.tokens, block) * block_bytes
        ideal_required = inputs.tokens * per_token
    if required is not None:
        required_blocks = _ceil_div(required, block_bytes)
        fits = required_blocks <= kv_blocks
        shortfall = 0 if fits else required_blocks * block_bytes - kv_budget

    return CapacityPlan(
        model=spec.name, attention_kind=spec.attention_kind, tp=tp, pp=pp, dtype=dtype,
        kv_dtype=kv_dtype, block_size=block, budget_mode=mode,
        gpu_memory_bytes=inputs.gpu_memory_bytes, utilization=utilization, budget_bytes=budget,
        weights_bytes=weights, weights_estimated=inputs.weights_bytes is None,
        non_kv_bytes=non_kv, non_kv_estimated=inputs.non_kv_bytes is None,
        kv_bytes_per_token=per_token, block_bytes=block_bytes, kv_budget_bytes=kv_budget,
        kv_blocks=kv_blocks, ideal_kv_blocks=max(0, kv_budget) / block_bytes,
        max_resident_tokens=kv_blocks * block, ideal_max_resident_tokens=max(0, kv_budget) // per_token,
        seq_len=inputs.seq_len, seqs=inputs.seqs, tokens=inputs.tokens,
        seq_kv_bytes=seq_kv, ideal_seq_kv_bytes=ideal_seq_kv,
        max_concurrent_seqs=max_concurrent, ideal_max_concurrent_seqs=ideal_concurrent,
        required_kv_bytes=required, ideal_required_kv_bytes=ideal_required,
        fits=fits, shortfall_bytes=shortfall, table=table,
    )
