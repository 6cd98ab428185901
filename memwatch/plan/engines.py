"""Each engine's own KV budget rule and defaults, as its source computes them at startup.

The vLLM rules follow the release the plan is told (``--engine-version``; the newest below when unsaid), each
as the released wheel the adapters are tested against has it; a test reads them, and nano-vllm's defaults,
in those wheels.

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
           ``--kv-cache-memory-bytes`` replaces the whole rule. vLLM 0.33: blocks of 16 tokens
           (``DEFAULT_BLOCK_SIZE``), utilization 0.92 (``CacheConfig``, ``vllm/config/cache.py``).
           vLLM 0.34 sizes the same way only without its extensible KV cache, and with blocks of 64
           tokens (``DEFAULT_BLOCK_SIZE``, ``vllm/config/cache.py`` line 185). Its extensible KV cache is on by
           default on CUDA unless ``kv_cache_memory_bytes`` (or a block-count override) is given
           (``VllmConfig._resolve_extensible_kv_cache``, ``vllm/config/vllm.py`` line 3180); an unset
           utilization then resolves to 1.0, else to ``DEFAULT_GPU_MEMORY_UTILIZATION`` 0.92
           (``resolved_gpu_memory_utilization``, ``vllm/config/cache.py`` lines 186 and 495–501). The cache
           is sized after warmup and CUDA-graph capture from the memory measured free
           (``measure_kv_cache_bytes``, ``vllm/v1/worker/extensible_kv_cache.py`` lines 613–618):
           ``min(requested − non-KV used, free − margin) − activation peak``, where non-KV used is what the
           instance took since start-up (weights and graphs), free is the device's free memory then (so
           memory outside PyTorch is deducted), and the margin is ``max(1 GiB, 0.75 × activation peak)``
           (``KV_CACHE_MARGIN_FLOOR_BYTES``, ``KV_CACHE_MARGIN_FRACTION``, lines 64–65).
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
VLLM_VERSIONS = ("0.33", "0.34")
"""The vLLM releases (major.minor) whose rules and defaults the planner follows, oldest first."""
EXTENSIBLE_MARGIN_FLOOR = 1 * GIB
"""vLLM 0.34's ``KV_CACHE_MARGIN_FLOOR_BYTES`` on CUDA (``vllm/v1/worker/extensible_kv_cache.py`` line 64)."""
EXTENSIBLE_MARGIN_FRACTION = Decimal("0.75")
"""vLLM 0.34's ``KV_CACHE_MARGIN_FRACTION`` (line 65): the margin's share of the activation peak."""


def vllm_release(version: str | None) -> str:
    """The planned vLLM release, ``major.minor``, of ``0.34``, ``0.34.0`` or ``v0.34.1``; the newest when unsaid."""
    if version is None:
        return VLLM_VERSIONS[-1]
    parts = version.strip().removeprefix("v").split(".")
    release = ".".join(parts[:2])
    if release not in VLLM_VERSIONS:
        raise UsageError(f"vLLM {version!r} is not a release memwatch plans for; use one of "
                         f"{', '.join(VLLM_VERSIONS)}")
    return release


def extensible_by_default(version: str | None) -> bool:
    """Whether vLLM ``version`` sizes an extensible KV cache unless told otherwise (0.34 on: its CUDA default)."""
    return vllm_release(version) != "0.33"


@dataclass(frozen=True)
class EngineDefaults:
    """What an engine assumes when the user does not say."""

    block_size: int
    utilization: float | None
    """None: derived from the device (SGLang's ``mem_fraction_static``)."""
    max_num_batched_tokens: int
    max_num_seqs: int


def defaults(engine: str, gpu_memory_bytes: int | None, tp: int = 1, version: str | None = None,
             extensible: bool = False) -> EngineDefaults:
    """The engine's defaults for a device of ``gpu_memory_bytes``; for vLLM, of release ``version`` with or
    without its extensible KV cache."""
    if engine == "nano-vllm":
        return EngineDefaults(256, 0.9, 16_384, 512)
    if engine == "vllm":
        block, utilization = (16, 0.92) if vllm_release(version) == "0.33" else (64, 1.0 if extensible else 0.92)
        # EngineArgs.get_batch_defaults, the API server's column: 16,384 batched tokens and 1,024 sequences
        # from 160 GiB, 8,192 and 1,024 from 70 GiB, 2,048 and 256 below (``vllm/engine/arg_utils.py``).
        memory = gpu_memory_bytes or 0
        if memory >= 160 * GIB:
            return EngineDefaults(block, utilization, 16_384, 1_024)
        if memory >= 70 * GIB:
            return EngineDefaults(block, utilization, 8_192, 1_024)
        return EngineDefaults(block, utilization, 2_048, 256)
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
              non_torch: int, cudagraph: int, notes: dict[str, str], extensible: bool = False) -> Budget:
    """KV bytes per rank under ``engine``'s rule, with the lines that show how they were reached; ``extensible``:
    vLLM 0.34's extensible KV cache, sized on the memory measured free after warmup."""
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
    if engine == "vllm" and extensible:
        return _vllm_extensible(start, math.ceil(share), utilization, total, weights_line, activation_line,
                                non_torch_line, weights=weights, activation=activation, non_torch=non_torch,
                                cudagraph=cudagraph, notes=notes)
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


def _vllm_extensible(start: LedgerLine, requested: int, utilization: float, total: int, weights_line: LedgerLine,
                     activation_line: LedgerLine, non_torch_line: LedgerLine, *, weights: int, activation: int,
                     non_torch: int, cudagraph: int, notes: dict[str, str]) -> Budget:
    """vLLM 0.34's extensible KV cache: ``min(requested − weights − graphs, free − margin) − activation``, with free
    the device's memory less non-PyTorch, weights and graphs after capture (``measure_kv_cache_bytes``). The
    requested share is only a cap: vLLM starts whatever the device had free."""
    margin = max(EXTENSIBLE_MARGIN_FLOOR, int(activation * EXTENSIBLE_MARGIN_FRACTION))
    graphs = LedgerLine("−", "CUDA graphs", cudagraph, notes["cudagraph"])
    margin_note = "max(1 GiB, 0.75 × activation reserve): kept free of the measured memory"
    capped = requested - weights - cudagraph
    measured = total - non_torch - weights - cudagraph - margin
    kv = min(capped, measured) - activation
    requested_line = LedgerLine("×", f"utilization {utilization:g}", requested, "rounded up")
    if measured <= capped:  # the free memory measured after capture binds
        lines = (start, non_torch_line, weights_line, graphs, LedgerLine("−", "sizing margin", margin, margin_note),
                 activation_line, LedgerLine("=", "KV budget", kv),
                 LedgerLine("·", requested_line.label, requested, "the cap, not reached"))
    else:  # the requested share binds
        lines = (start, requested_line, weights_line, graphs, activation_line, LedgerLine("=", "KV budget", kv),
                 LedgerLine("·", "non-PyTorch", non_torch, f"{notes['non_torch']}; outside the share"))
    return Budget(requested, kv, lines)
