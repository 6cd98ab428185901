"""Capacity planning per rank: how much KV cache fits, and whether a target load does.

The ledger of one rank, planned in exact bytes under the engine's own rule (:mod:`memwatch.plan.engines`);
for nano-vllm::

    budget      = gpu_memory × utilization                (or kv_cache_memory_bytes, which replaces it)
    KV budget   = budget − non-PyTorch − weights − activation reserve
    KV blocks   = KV budget // block_bytes
    fits        = blocks the target needs <= KV blocks

Weights are priced tensor by tensor at the checkpoint's quantization (:mod:`memwatch.models.quantization`);
non-PyTorch memory defaults to an estimate (:mod:`memwatch.plan.non_torch`). A hybrid model's
non-attention layers add a fixed state per sequence to its KV.

A sequence of ``L`` tokens needs ``ceil(L / block_size)`` blocks of its full-attention layers and
``ceil(min(L, window) / block_size)`` of its sliding layers; the unrounded ("ideal") bytes are shown
beside the rounded ones. The shortfall is what the KV budget lacks for the target, so a plan 2.4 GiB
short needs 2.4 GiB more budget, never counted twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memwatch.errors import UsageError
from memwatch.models.quantization import from_option as quantization_from_option
from memwatch.models.spec import ModelSpec, canonical_dtype
from memwatch.plan import engines
from memwatch.plan.engines import LedgerLine
from memwatch.plan.non_torch import describe as describe_non_torch
from memwatch.plan.non_torch import non_torch_terms

DEFAULT_BLOCK_SIZE = 256
DEFAULT_UTILIZATION = 0.9
DEFAULT_MAX_NUM_BATCHED_TOKENS = 16_384
DEFAULT_MAX_NUM_SEQS = 512
DEFAULT_ENGINE = "nano-vllm"


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
    activation_reserve_bytes: int | None = None
    """The activation reserve (the profiling forward's peak); None: estimated on the engine's warmup."""
    non_torch_bytes: int | None = None
    """Memory outside PyTorch per rank; None: the estimate of :mod:`memwatch.plan.non_torch`."""
    cudagraph_bytes: int | None = None
    dtype: str | None = None
    kv_dtype: str | None = None
    quantization: str | None = None
    """``--quantization``: replaces the checkpoint's ``quantization_config``."""
    tp: int = 1
    pp: int = 1
    block_size: int | None = None
    seqs: int | None = None
    seq_len: int | None = None
    tokens: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    engine: str = DEFAULT_ENGINE
    engine_version: str | None = None
    """vLLM's release (``0.33``, ``0.34``, ``0.34.0``): whose defaults and sizing; None: the newest planned for."""
    extensible_kv_cache: bool | None = None
    """vLLM 0.34's extensible KV cache; None: the release's default (on unless the KV size is explicit)."""


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
    engine: str
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
    weights_source: str
    num_parameters: int
    activation_reserve_bytes: int
    activation_reserve_estimated: bool
    non_torch_bytes: int
    non_torch_estimated: bool
    non_torch_terms: dict[str, int]
    cudagraph_bytes: int
    state_bytes_per_seq: int
    """Fixed bytes per sequence in a hybrid model's non-attention layers (0 for pure attention)."""
    state_note: str
    ledger: tuple[LedgerLine, ...]
    startup_error: str | None
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
    engine_version: str | None = None
    """The vLLM release planned for (``None`` for the other engines)."""
    extensible_kv_cache: bool = False
    """Whether the plan sizes vLLM's extensible KV cache (on the memory measured free after warmup)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["table"] = [asdict(row) for row in self.table]
        data["ledger"] = [asdict(line) for line in self.ledger]
        return data


MAX_BLOCK_TOKENS = 1 << 20
"""The largest KV block taken (engines use 16 to 256 tokens); beyond it the arithmetic leaves floating point."""


MAX_TARGET = 1 << 40
"""The largest target taken (sequences, tokens per sequence, tokens): far past any device, inside exact floats."""


def _check_inputs(inputs: PlanInputs) -> None:
    if inputs.utilization is not None and inputs.kv_cache_memory_bytes is not None:
        raise PlanError("--utilization and --kv-cache-memory-bytes are mutually exclusive: the explicit "
                        "KV size replaces the utilization budget; pass one of them")
    if inputs.kv_cache_memory_bytes is None and inputs.gpu_memory_bytes is None:
        raise PlanError("the plan needs --gpu-memory (the device's total bytes, e.g. 24GiB or "
                        "25769803776) or an explicit --kv-cache-memory-bytes")
    if inputs.utilization is not None and not 0 < inputs.utilization <= 1:
        raise PlanError(f"utilization must be in (0, 1], got {inputs.utilization}")
    if inputs.block_size is not None and not 1 <= inputs.block_size <= MAX_BLOCK_TOKENS:
        shown = inputs.block_size if inputs.block_size < 10**30 else "a number that large"
        raise PlanError(f"block size must be at least 1 token and at most {MAX_BLOCK_TOKENS:,}, got {shown}")
    if inputs.engine not in engines.ENGINES:
        raise PlanError(f"unknown engine {inputs.engine!r}; use one of {', '.join(engines.ENGINES)}")
    if inputs.tokens is not None and (inputs.seqs is not None or inputs.seq_len is not None):
        raise PlanError("give the target as --seqs N --seq-len L or as --tokens T, not both")
    if inputs.seqs is not None and inputs.seq_len is None:
        raise PlanError("--seqs needs --seq-len, the cached tokens of each sequence")
    for name in ("seqs", "seq_len", "tokens"):
        value = getattr(inputs, name)
        if value is not None and not 1 <= value <= MAX_TARGET:
            shown = value if value < 10**30 else "a number that large"
            raise PlanError(f"--{name.replace('_', '-')} must be at least 1 and at most {MAX_TARGET:,}, got {shown}")
    if inputs.engine != "vllm" and (inputs.engine_version is not None or inputs.extensible_kv_cache is not None):
        raise PlanError("--engine-version and --extensible-kv-cache describe vLLM releases; plan with --engine vllm")
    version = engines.vllm_release(inputs.engine_version) if inputs.engine == "vllm" else None
    if inputs.extensible_kv_cache and version == "0.33":
        raise PlanError("vLLM 0.33 has no extensible KV cache; it came with 0.34")
    if inputs.extensible_kv_cache and inputs.kv_cache_memory_bytes is not None:
        raise PlanError("vLLM refuses an extensible KV cache with kv_cache_memory_bytes: it sizes the cache from "
                        "measured memory, which the explicit size overrides")


def _extensible(inputs: PlanInputs) -> bool:
    """Whether vLLM sizes an extensible KV cache: asked for, else its release's default, never beside an explicit
    KV size (``VllmConfig._resolve_extensible_kv_cache``)."""
    if inputs.engine != "vllm" or inputs.kv_cache_memory_bytes is not None:
        return False
    if inputs.extensible_kv_cache is not None:
        return inputs.extensible_kv_cache
    return engines.extensible_by_default(inputs.engine_version)


def _sequence_kv_bytes(spec: ModelSpec, inputs: PlanInputs, kv_dtype: str, seq_len: int,
                       block: int) -> tuple[int, int]:
    """(block-rounded, ideal) KV bytes of one sequence on the busiest pipeline rank."""
    window = spec.sliding_window or seq_len
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


def _weights(spec: ModelSpec, inputs: PlanInputs, dtype: str) -> tuple[int, str]:
    """Weight bytes of the busiest rank and where they come from."""
    if inputs.weights_bytes is not None:
        return inputs.weights_bytes, "given (--weights-bytes)"
    scheme = (spec.quantization if inputs.quantization is None
              else quantization_from_option(inputs.quantization))
    weights = spec.weight_bytes(dtype, inputs.tp, inputs.pp, quantization=scheme)
    params = f"{spec.num_parameters():,} parameters" + (f" ({spec.uncounted})" if spec.uncounted else "")
    if scheme.quantized:
        return weights, f"{params}; linear layers {scheme.describe()}, the rest {dtype}"
    return weights, f"{params} × {dtype}"


def _state_note(spec: ModelSpec, state: int) -> str:
    if not state:
        return ""
    mixers = spec.num_hidden_layers - len(spec.attention_layers or ())
    return (f"{mixers} of {spec.num_hidden_layers} layers are {spec.mixer_kind} mixers: no per-token KV, "
            f"a fixed state of {state:,} B per sequence (convolution window and SSM state)")


def plan_capacity(spec: ModelSpec, inputs: PlanInputs) -> CapacityPlan:
    """Work out one rank's KV budget and whether the target load fits in it."""
    _check_inputs(inputs)
    engine = inputs.engine
    dtype = canonical_dtype(inputs.dtype or spec.dtype)
    kv_dtype = canonical_dtype(inputs.kv_dtype or inputs.dtype or spec.dtype)
    tp, pp = inputs.tp, inputs.pp
    version = engines.vllm_release(inputs.engine_version) if engine == "vllm" else None
    extensible = _extensible(inputs)
    rules = engines.defaults(engine, inputs.gpu_memory_bytes, tp, version, extensible)
    block = inputs.block_size or rules.block_size
    batched = inputs.max_num_batched_tokens or rules.max_num_batched_tokens
    max_seqs = inputs.max_num_seqs or rules.max_num_seqs
    per_token = spec.kv_bytes_per_token(tp, pp, kv_dtype)
    block_bytes = spec.block_bytes(block, tp, kv_dtype, pp)
    state = spec.state_bytes_per_sequence(tp, pp, dtype)  # the mixers' state is kept at the model's precision

    weights, weights_source = _weights(spec, inputs, dtype)
    non_kv = inputs.activation_reserve_bytes
    if non_kv is None:
        non_kv = engines.activation_bytes(engine, spec, tp, batched, inputs.seq_len, max_seqs)
    terms = non_torch_terms(tp, pp, engine) if inputs.non_torch_bytes is None else {}
    non_torch = sum(terms.values()) if inputs.non_torch_bytes is None else inputs.non_torch_bytes
    cudagraph = inputs.cudagraph_bytes
    if cudagraph is None:
        cudagraph = engines.vllm_cudagraph_bytes(spec, tp, max_seqs, batched) if engine == "vllm" else 0
    notes = {
        "weights": weights_source,
        "activation": ("given (--activation-reserve-bytes)" if inputs.activation_reserve_bytes is not None
                       else "estimate (warmup)"),
        "non_torch": describe_non_torch(terms) if terms else "given (--non-torch-bytes)",
        "cudagraph": "given (--cudagraph-bytes)" if inputs.cudagraph_bytes is not None else "estimate",
    }

    startup_error = None
    if inputs.kv_cache_memory_bytes is not None:
        mode, utilization, budget = "kv_cache_memory_bytes", None, None
        kv_budget = inputs.kv_cache_memory_bytes
        ledger: tuple[LedgerLine, ...] = (
            LedgerLine("·", "weights", weights, notes["weights"] + "; not deducted"),
            LedgerLine("·", "activation reserve", non_kv, notes["activation"] + "; not deducted"),
            LedgerLine("·", "non-PyTorch", non_torch, notes["non_torch"] + "; not deducted"),
            LedgerLine("", "KV budget", kv_budget, "--kv-cache-memory-bytes"),
        )
    else:
        mode = "utilization"
        utilization = inputs.utilization
        if utilization is None:
            utilization = rules.utilization
            if utilization is None:
                utilization = engines.sglang_mem_fraction_static(inputs.gpu_memory_bytes or 0, tp, pp)
                notes["utilization"] = "SGLang's automatic value for this device"
        split = engines.kv_budget(engine, inputs.gpu_memory_bytes or 0, utilization, weights=weights,
                                  activation=non_kv, non_torch=non_torch, cudagraph=cudagraph, notes=notes,
                                  extensible=extensible)
        budget, kv_budget, ledger, startup_error = (split.budget_bytes, split.kv_budget_bytes, split.lines,
                                                    split.startup_error)
    kv_blocks = max(0, kv_budget) // block_bytes if not startup_error else 0
    if kv_blocks == 0 and startup_error is None:
        # Every engine refuses a cache of no block (nano-vllm asserts num_kvcache_blocks > 0, vLLM and SGLang
        # raise), so a plan without one is a start that fails, whatever the target.
        advice = ("a larger --kv-cache-memory-bytes" if mode == "kv_cache_memory_bytes"
                  else "a larger GPU, a higher --utilization or more --tp")
        startup_error = (f"{engine} refuses to start: the KV budget ({kv_budget:,} B) holds no block of "
                         f"{block_bytes:,} B; give it {advice}")
    pool = kv_blocks * block_bytes

    seq_kv = ideal_seq_kv = max_concurrent = ideal_concurrent = None
    required = ideal_required = fits = shortfall = None
    table: tuple[LoadRow, ...] = ()
    if inputs.seq_len is not None:
        seq_kv, ideal_seq_kv = _sequence_kv_bytes(spec, inputs, kv_dtype, inputs.seq_len, block)
        seq_kv, ideal_seq_kv = seq_kv + state, ideal_seq_kv + state
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
        fits = required_blocks <= kv_blocks and startup_error is None
        shortfall = 0 if fits else max(0, required_blocks * block_bytes - kv_budget)

    return CapacityPlan(
        model=spec.name, engine=engine, attention_kind=spec.attention_kind, tp=tp, pp=pp, dtype=dtype,
        kv_dtype=kv_dtype, block_size=block, budget_mode=mode,
        gpu_memory_bytes=inputs.gpu_memory_bytes, utilization=utilization, budget_bytes=budget,
        weights_bytes=weights, weights_estimated=inputs.weights_bytes is None, weights_source=weights_source,
        num_parameters=spec.num_parameters(),
        activation_reserve_bytes=non_kv, activation_reserve_estimated=inputs.activation_reserve_bytes is None,
        non_torch_bytes=non_torch, non_torch_estimated=inputs.non_torch_bytes is None,
        non_torch_terms=terms, cudagraph_bytes=cudagraph,
        state_bytes_per_seq=state, state_note=_state_note(spec, state), ledger=ledger,
        startup_error=startup_error,
        kv_bytes_per_token=per_token, block_bytes=block_bytes, kv_budget_bytes=kv_budget,
        kv_blocks=kv_blocks, ideal_kv_blocks=max(0, kv_budget) / block_bytes,
        max_resident_tokens=kv_blocks * block, ideal_max_resident_tokens=max(0, kv_budget) // per_token,
        seq_len=inputs.seq_len, seqs=inputs.seqs, tokens=inputs.tokens,
        seq_kv_bytes=seq_kv, ideal_seq_kv_bytes=ideal_seq_kv,
        max_concurrent_seqs=max_concurrent, ideal_max_concurrent_seqs=ideal_concurrent,
        required_kv_bytes=required, ideal_required_kv_bytes=ideal_required,
        fits=fits, shortfall_bytes=shortfall, table=table, engine_version=version, extensible_kv_cache=extensible,
    )
