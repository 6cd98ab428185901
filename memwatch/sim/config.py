"""The settings a simulation runs with: the device, the engine, the virtual costs and the startup knobs.

Plain frozen dataclasses, imported by everything else in the simulator and importing nothing of it
but the allocator's constants. The simulator's modules form one chain: ``gpu`` and ``config`` at the
bottom, then ``faults`` (the fault interface and registry) and ``fault_kinds``, then ``scenario``
(loading files), ``runner`` and ``engine`` (executing), and ``run``/``scorecard`` on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from memwatch.errors import UsageError
from memwatch.sim.gpu import DEFAULT_CONTEXT_BYTES, MiB

ATTENTION_IMPLEMENTATIONS = ("flash", "eager")
ENGINE_RULES = ("nano-vllm", "vllm", "sglang")


@dataclass(frozen=True)
class GPUConfig:
    total_bytes: int
    context_bytes: int = DEFAULT_CONTEXT_BYTES
    name: str = "Virtual GPU"

    def __post_init__(self) -> None:
        if self.total_bytes <= 0 or not 0 <= self.context_bytes < self.total_bytes:
            raise UsageError("[gpu] needs total_bytes > 0 and 0 <= context_bytes < total_bytes")


@dataclass(frozen=True)
class EngineConfig:
    """nano-vllm's ``Config`` fields that shape memory, with its defaults."""

    gpu_memory_utilization: float = 0.9
    block_size: int = 256
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    dtype: str | None = None
    """Model precision; ``None`` keeps the config's ``torch_dtype``."""
    enforce_eager: bool = False
    """``False`` captures CUDA graphs for decode after the KV cache is allocated."""
    attention: str = "flash"
    nccl_bytes: int = 128 * MiB
    """NCCL buffers each rank takes outside the allocator on its first all-reduce (only when TP > 1)."""
    rules: str = "nano-vllm"
    """Whose checks the settings pass and whose KV rule sizes the cache: ``"vllm"`` for a replay of a vLLM
    run, whose ``CacheConfig`` takes any block size above 0 (its default is 16) where nano-vllm asserts a
    multiple of 256; ``"sglang"`` for SGLang's token pool (:mod:`memwatch.sglang_rule`): a block is one
    token (``block_size = 1``), ``gpu_memory_utilization`` is SGLang's ``mem_fraction_static``, and no
    profiling forward runs before sizing (SGLang keeps ``1 − mem_fraction_static`` of the memory free
    before the weights for activations instead)."""
    page_size: int = 1
    """SGLang's ``page_size``: its pool holds a whole number of pages (``"sglang"`` rules only)."""
    max_total_tokens: int | None = None
    """SGLang's ``max_total_tokens``: a cap on the pool (``"sglang"`` rules only)."""

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UsageError(f"[engine] gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.rules not in ENGINE_RULES:
            raise UsageError(f"[engine] rules must be one of {', '.join(ENGINE_RULES)}, got {self.rules!r}")
        if self.rules == "vllm" and self.block_size < 1:
            raise UsageError(f"[engine] block_size must be above 0 (vLLM's CacheConfig checks it), "
                             f"got {self.block_size}")
        if self.rules == "sglang" and (self.block_size != 1 or self.page_size < 1
                                       or (self.max_total_tokens is not None and self.max_total_tokens < 1)):
            raise UsageError("[engine] SGLang's pool counts tokens: block_size must be 1, page_size and "
                             "max_total_tokens at least 1")
        if self.rules == "nano-vllm" and (self.block_size < 256 or self.block_size % 256):
            raise UsageError(f"[engine] block_size must be a multiple of 256 (nano-vllm asserts it), "
                             f"got {self.block_size}")
        if min(self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len) < 1:
            raise UsageError("[engine] max_num_batched_tokens, max_num_seqs and max_model_len must be >= 1")
        if not 1 <= self.tensor_parallel_size <= 8:
            raise UsageError(f"[engine] tensor_parallel_size must be between 1 and 8, got {self.tensor_parallel_size}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise UsageError(f"[engine] attention must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, "
                             f"got {self.attention!r}")
        if self.nccl_bytes < 0:
            raise UsageError("[engine] nccl_bytes cannot be negative")


@dataclass(frozen=True)
class CostModel:
    """How much virtual time each part of a run takes; runs themselves take wall-clock seconds."""

    prefill_tokens_per_s: float = 8000.0
    decode_step_s: float = 0.025
    decode_per_seq_s: float = 0.0001
    load_bytes_per_s: float = 2.0e9
    graph_capture_s: float = 0.01
    """Per captured batch size."""

    def __post_init__(self) -> None:
        if min(self.prefill_tokens_per_s, self.load_bytes_per_s) <= 0:
            raise UsageError("[cost] prefill_tokens_per_s and load_bytes_per_s must be positive")
        if min(self.decode_step_s, self.decode_per_seq_s, self.graph_capture_s) < 0:
            raise UsageError("[cost] decode_step_s, decode_per_seq_s and graph_capture_s cannot be negative")




@dataclass
class StartupBehaviour:
    """The startup choices faults may change; the defaults are nano-vllm's."""

    load_staging_bytes: int | None = None
    """The transient copy made while loading; ``None``: one decoder layer's weights."""
    reset_peak_before_warmup: bool = True
    warmup_prefill: bool = True
    warmup_num_seqs: int | None = None
    """``None``: the worst case from ``warmup_batch``."""
    warmup_seq_len: int | None = None
