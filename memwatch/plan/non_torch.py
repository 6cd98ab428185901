"""The default estimate of memory outside PyTorch per rank: the CUDA context, NCCL and cuBLAS.

An engine's budget rule sees this memory through the driver (``used`` in nano-vllm's formula,
the free memory SGLang reads before loading weights) although PyTorch's allocator never holds it,
so a plan that leaves it at zero promises KV blocks no real GPU has. Without a measurement the
estimate is:

* **CUDA context: 512 MiB per device.** The context plus the kernels PyTorch and the engine load
  (lazily since CUDA 12.2 on Linux) is a few hundred MiB, depending on GPU, driver and CUDA
  version (PyTorch's notes on CUDA memory; NVIDIA's lazy-loading documentation). Measured: the
  simulator's reference run (``memwatch demo``) holds 611 MiB outside PyTorch's allocations on a
  24 GiB device, of which 512 MiB is context; vLLM's own profiling logs report 0.2 to 1.8 GiB of
  non-torch memory at TP 1 (vllm-project/vllm PR #10511, PR #14447), the upper figure including
  compilation and graph buffers.
* **cuBLAS/cuBLASLt workspaces: 0.** Current PyTorch allocates them through its caching allocator,
  so they count as PyTorch memory, not here.
* **NCCL: ``tp × pp / 8`` GiB, at least 256 MiB, when more than one rank.** This is SGLang's own
  allowance for parallel sizes (``handle_gpu_memory_settings``: ``tp × pp / 8 × 1024`` MB); NCCL's
  buffers grow with the channel count and peers, and vLLM adds custom all-reduce buffers (PR #10511
  logs 1.79 GiB more non-torch memory at TP 2 than at TP 1 on an H100).
* **vLLM's custom all-reduce: 24 MiB, at TP 2, 4, 6, 8 or 16.** vLLM 0.33.0's ``CustomAllreduce``
  (``vllm/distributed/device_communicators/custom_all_reduce.py``) takes two IPC buffers with
  ``cudaMalloc``, outside PyTorch's allocator: the signal area plus a ``max_size`` temporary buffer
  (8 MiB), and the registered input buffer of ``max(max_size, all-gather 2 MiB, reduce-scatter
  16 MiB)`` = 16 MiB; its 8 MiB ``rank_data`` is a PyTorch tensor. nano-vllm reduces through NCCL
  alone; SGLang's allowance above already covers its own.

The context and NCCL terms serve every engine; each engine's rule decides whether the estimate is
deducted (:mod:`memwatch.plan.engines`). ``--non-torch-bytes`` replaces it with a measured figure.
"""

from __future__ import annotations

MIB = 1 << 20
GIB = 1 << 30
CUDA_CONTEXT_BYTES = 512 * MIB
NCCL_MIN_BYTES = 256 * MIB
VLLM_CUSTOM_ALL_REDUCE_BYTES = 8 * MIB + 16 * MIB
VLLM_CUSTOM_ALL_REDUCE_SIZES = (2, 4, 6, 8, 16)
"""The tensor-parallel sizes vLLM's custom all-reduce supports (``_SUPPORTED_WORLD_SIZES``)."""


def non_torch_terms(tp: int = 1, pp: int = 1, engine: str = "nano-vllm") -> dict[str, int]:
    """The estimate per rank, by term (``cuda_context``, ``nccl``; ``custom_all_reduce`` for vLLM)."""
    world = tp * pp
    nccl = max(NCCL_MIN_BYTES, world * GIB // 8) if world > 1 else 0
    terms = {"cuda_context": CUDA_CONTEXT_BYTES, "nccl": nccl}
    if engine == "vllm":
        terms["custom_all_reduce"] = VLLM_CUSTOM_ALL_REDUCE_BYTES if tp in VLLM_CUSTOM_ALL_REDUCE_SIZES else 0
    return terms


def describe(terms: dict[str, int]) -> str:
    """``estimate: CUDA context 512 MiB + NCCL 256 MiB``."""
    names = {"cuda_context": "CUDA context", "nccl": "NCCL", "custom_all_reduce": "vLLM custom all-reduce"}
    parts = [f"{names.get(key, key)} {value // MIB:,} MiB" for key, value in terms.items() if value]
    return "estimate: " + " + ".join(parts)
