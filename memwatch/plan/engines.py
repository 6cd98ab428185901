"""Each engine's own KV budget rule and defaults, as its source computes them at startup.

The vLLM functions below are those of vLLM 0.33.0, the release the adapters are tested against; a test
reads them, and nano-vllm's defaults, in the released wheels.

=========  ============================================================================================
nano-vllm  ``num_blocks = int(total × util − used − peak + current) // block_bytes``
           (``ModelRunner.allocate_kv_cache``, ``nanovllm/engine/model_runner.py``): the KV cache gets
           ``total × util − non-PyTorch − weights − activation reserve``. Everything on the device counts,
           the CUDA context and NCCL buffers included. Blocks of 256 tokens, utilization 0.9,
           ``max_num_batched_tokens`` 16,384, ``max_num_seqs`` 512 (``nanovllm/config.py``).
vLLM       ``available_kv_cache_memory_bytes = requested_memory − non_kv_cache_memory −
           cudagraph_memory_estimate`` with ``requested_memory = ceil(total × gpu_memory_utilization)``
           (``Worker.determine_available_memory``, ``vllm/v1/worker/gpu_worker.py``; ``request_memory``,
           ``vllm/v1/worker/utils.py``). ``non_kv_cache_memory`` is what profiling consumed since the
           baseline snapshot, which ``Worker.init_device`` takes *after* creating the CUDA context,
           NCCL and the cuBLAS handles: weights plus the activation peak, while the memory outside
           PyTorch is not deducted and must fit in ``total × (1 − util)`` (else vLLM refuses to start:
           "Free memory on device … is less than desired GPU memory utilization").
           ``--kv-cache-memory-bytes`` replaces the whole rule. Blocks of 16 tokens
           (``DEFAULT_BLOCK_SIZE``), utilization 0.92 (``CacheConfig``, ``vllm/config/cache.py``).
           The CUDA-graph estimate (``GPUModelRunner.profile_cudagraph_memory``: the first capture plus
           at least 1 MiB for each further one, in one shared pool) is approximated here as the decode
           activation peak of the largest captured batch plus 1 MiB per captured size, with vLLM's
           capture sizes ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)`` up to ``max =
           min(2 × max_num_seqs, 512, max_num_batched_tokens)``, plus ``max_num_batched_tokens`` and
           ``max_num_seqs`` where they fit under ``max`` (``VllmConfig._set_cudagraph_sizes``,
           ``vllm/config/vllm.py``; without speculative decoding, on devices other than Blackwell,
           whose ceiling is 1,024).
           The profile run's batch is the serving default of ``EngineArgs.get_batch_defaults``
           (``vllm/engine/arg_utils.py``): 16,384 tokens and 1,024 sequences on devices of 160 GiB and
           more, 8,192 and 1,024 from 70 GiB (except A100s and GB10s, which the device size cannot tell
           apart), 2,048 and 256 below.
SGLang     ``rest_memory = available − pre_model_load_memory × (1 − mem_fraction_static)``
           (``KVCacheConfigurator._profile_available_bytes``, ``python/sglang/srt/mem_cache/
           kv_cache_configurator.py``), with ``pre_model_load_memory`` the free memory after the
           distributed init (context and NCCL already taken) and ``available`` the free memory after
           the weights: the KV pool gets ``(total − non-PyTorch) × mem_fraction_static − weights``.
           Activations and CUDA graphs live in the remainder and are not deducted. Pages of one
           token. Without ``--utilization`` (which stands for ``mem_fraction_static`` here) the
           fraction follows ``handle_gpu_memory_settings`` (``python/sglang/srt/arg_groups/
           memory_hook.py``): ``reserved = 512 + 1.5 × max(chunked_prefill_size, 2048) + tp × pp / 8 ×
           1024 + 2 × decode max_bs`` MB (at least 10 GiB on devices over 60 GiB) and
           ``mem_fraction_static = round((gpu_mb − reserved) / gpu_mb, 3)``; prefill CUDA graphs and
           DP-attention, DeepEP and multimodal adjustments are left out.
=========  ============================================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from memwatch.errors import UsageError
from memwatch.models.activation import forward_activation_bytes, warmup_batch
from memwatch.models.spec import ModelSpec

ENGINES = ("nano-vllm", "vllm", "sglang")
MIB = 1 << 20
GIB = 1 << 30
CUDAGRAPH_BYTES_PER_GRAPH = 1 * MIB


@dataclass(frozen=True)
class EngineDefaults:
    """What an engine assumes when the user does not say."""

    block_size: int
    utilization: float | None
    """None: derived from the device (SGLang's ``mem_fraction_static``)."""
    max_num_batched_tokens: int
    max_num_seqs: int


def defaults(engine: str, gpu_memory_bytes: int | None, tp: int = 1) -> EngineDefaults:
    """The engine's defaults for a device of ``gpu_memory_bytes``."""
    if engine == "nano-vllm":
        return EngineDefaults(256, 0.9, 16_384, 512)
    if engine == "vllm":
        # EngineArgs.get_batch_defaults, the API server's column: 16,384 batched tokens and 1,024 sequences
        # from 160 GiB, 8,192 and 1,024 from 70 GiB, 2,048 and 256 below (``vllm/engine/arg_utils.py``).
        memory = gpu_memory_bytes or 0
        if memory >= 160 * GIB:
            return EngineDefaults(16, 0.92, 16_384, 1_024)
        if memory >= 70 * GIB:
            return EngineDefaults(16, 0.92, 8_192, 1_024)
        return EngineDefaults(16, 0.92, 2_048, 256)
    if engine == "sglang":
        chunked, _ = _sglang_capacity(gpu_memory_bytes, tp)
        return EngineDefaults(1, None, chunked, _sglang_capacity(gpu_memory_bytes, tp)[1])
    raise UsageError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")


def _sglang_capacity(gpu_memory_bytes: int | None, tp: int) -> tuple[int, int]:
    """SGLang's ``(chunked_prefill_size, decode cuda graph max_bs)`` for a device size."""
    if gpu_memory_bytes is None:
        return 4096, 160
    mb = gpu_memory_bytes / MIB
    if mb < 20 * 1024:
        return 2048, 8
    if mb < 35 * 1024:
        return 4096, 48 if tp < 4 else 160
    if mb < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if mb < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def sglang_mem_fraction_static(gpu_memory_bytes: int, tp: int = 1, pp: int = 1) -> float:
    """SGLang's automatic ``mem_fraction_static`` for a device (see the module docstring)."""
    gpu_mb = gpu_memory_bytes / MIB
    chunked, max_bs = _sglang_capacity(gpu_memory_bytes, tp)
    reserved = 512 + 1.5 * max(chunked, 2048) + tp * pp / 8 * 1024 + 2 * max_bs
    if gpu_mb > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mb - reserved) / gpu_mb, 3)


def vllm_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM's default CUDA-graph capture sizes for ``max_num_seqs`` and ``max_num_batched_tokens``."""
    largest = min(2 * max_num_seqs, 512, max_num_batched_tokens)
    sizes = {1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16), max_num_batched_tokens, max_num_seqs}
    return sorted(size for size in sizes if size <= largest)


def vllm_cudagraph_bytes(spec: ModelSpec, tp: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The CUDA-graph estimate vLLM deducts, approximated (see the module docstring)."""
    sizes = vllm_capture_sizes(max_num_seqs, max_num_batched_tokens)
    largest = max(sizes)
    return forward_activation_bytes(spec, largest, largest, prefill=False, tp=tp, max_seq_len=1) \
        + len(sizes) * CUDAGRAPH_BYTES_PER_GRAPH


def activation_bytes(engine: str, spec: ModelSpec, tp: int, max_num_batched_tokens: int,
                     max_model_len: int | None, max_num_seqs: int) -> int:
    """The activation peak of the engine's profiling forward (nano-vllm's warmup, vLLM's profile run)."""
    if engine == "vllm":
        seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
        return forward_activation_bytes(spec, max_num_batched_tokens, seqs, prefill=True, tp=tp)
    model_len = max_model_len or max_num_batched_tokens
    num_seqs, seq_len = warmup_batch(max_num_batched_tokens, model_len, max_num_seqs)
    return forward_activation_bytes(spec, num_seqs * seq_len, num_seqs, prefill=True, tp=tp)


@dataclass(frozen=True)
class LedgerLine:
    """One printed line of a budget: ``op`` is ``""`` (a start), ``"×"``, ``"−"``, ``"="`` or ``"·"``
    (shown but not deducted)."""

    op: str
    label: str
    num_bytes: int
    note: str = ""


@dataclass(frozen=True)
class Budget:
    """The engine's split of the device: the lines it deducts, and the KV bytes left."""

    budget_bytes: int
    kv_budget_bytes: int
    lines: tuple[LedgerLine, ...]
    startup_error: str | None = None


def kv_budget(engine: str, total: int, utilization: float, *, weights: int, activation: int,
              non_torch: int, cudagraph: int, notes: dict[str, str]) -> Budget:
    """KV bytes per rank under ``engine``'s rule, with the lines that show how they were reached."""
    share = Decimal(total) * Decimal(str(utilization))
    start = LedgerLine("", "GPU memory", total, notes.get("gpu", ""))
    weights_line = LedgerLine("−", "weights", weights, notes["weights"])
    activation_line = LedgerLine("−", "activation reserve", activation, notes["activation"])
    non_torch_line = LedgerLine("−", "non-PyTorch", non_torch, notes["non_torch"])
    if engine == "nano-vllm":
        budget = int(share)
        kv = budget - non_torch - weights - activation
        lines = (start, LedgerLine("×", f"utilization {utilization:g}", budget),
                 non_torch_line, weights_line, activation_line)
        return Budget(budget, kv, (*lines, LedgerLine("=", "KV budget", kv)))
    if engine == "vllm":
        budget = math.ceil(share)
        kv = budget - weights - activation - cudagraph
        slack = total - budget
        lines = (start, LedgerLine("×", f"utilization {utilization:g}", budget, "rounded up"),
                 weights_line, activation_line,
                 LedgerLine("−", "CUDA graphs", cudagraph, notes["cudagraph"]),
                 LedgerLine("=", "KV budget", kv),
                 LedgerLine("·", "non-PyTorch", non_torch,
                            f"{notes['non_torch']}; outside the budget, "
                            f"must fit in total × (1 − util) = {slack:,} B"))
        error = None
        if non_torch > slack:
            error = (f"vLLM refuses to start: memory outside PyTorch ({non_torch:,} B) exceeds "
                     f"total × (1 − utilization) ({slack:,} B); lower --utilization")
        return Budget(budget, kv, lines, error)
    if engine == "sglang":
        before_load = total - non_torch
        budget = int(Decimal(before_load) * Decimal(str(utilization)))
        kv = budget - weights
        lines = (start, non_torch_line,
                 LedgerLine("×", f"mem_fraction_static {utilization:g}", budget, notes.get("utilization", "")),
                 weights_line, LedgerLine("=", "KV budget", kv),
                 LedgerLine("·", "activation reserve", activation,
                            "not deducted: runs in the (1 − mem_fraction_static) remainder"))
        return Budget(budget, kv, lines)
    raise UsageError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
