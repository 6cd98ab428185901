"""What stands in for the GPU under the released vLLM (``vllm_driver.py``), and the engine core's parts it drives.

The worker's device bring-up and a CPU model runner (KV allocation through vLLM's ``allocate_kv_cache``,
token 7 for every request), the configs, the KV-cache plan as the engine core makes it, and its serving loop.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

MiB = 1 << 20
GRANULE = 2 * MiB
"""The driver's allocation granularity (``cuMemGetAllocationGranularity`` on current GPUs)."""


class CpuModelRunner:
    """The model runner's KV allocation, as ``GPUModelRunner.initialize_kv_cache`` does it, on CPU."""

    model_memory_usage = 0
    is_pooling_model = False  # vLLM 0.34's Worker.execute_model asks

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.allocated_bytes = 0

    def initialize_kv_cache(self, kv_cache_config: Any, kv_cache_allocation_context: Any = None,
                            extensible: bool = False) -> None:
        self.kv_cache_config = kv_cache_config  # as GPUModelRunner.initialize_kv_cache keeps it
        if extensible:  # vLLM 0.34: an address range is reserved, nothing committed until extend_kv_cache
            self.extensible_kv_cache = SimpleNamespace(reserved_headroom_bytes=0, warmup_committable_blocks=0,
                                                       committable_blocks=lambda: kv_cache_config.num_blocks,
                                                       physical_bytes=0)
            return
        self.allocate(kv_cache_config)

    def allocate(self, kv_cache_config: Any) -> None:
        """vLLM's ``allocate_kv_cache`` of ``kv_cache_config``, on CPU; the bytes it allocated."""
        import torch
        from vllm.v1.worker.utils import allocate_kv_cache

        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        buffers = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in caches.values()}
        self.allocated_bytes = sum(buffers.values())

    def profile_run(self, randomize_inputs: bool = False) -> None:
        """The profiling forward: nothing runs on CPU, so nothing is allocated."""

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        """The model's output for a step: one token per request, plus its draft tokens (all accepted)."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(scheduler_output.num_scheduled_tokens)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        sampled = [[7] * (1 + len(drafts.get(req_id, ()))) for req_id in req_ids]
        if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # vLLM 0.33; 0.34 indexes by position
            return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
                                     sampled_token_ids=sampled)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def shutdown(self) -> None:
        pass


def cpu_extensible_kv_cache(gpu_worker: Any) -> None:
    """What stands for the device's virtual memory under vLLM 0.34's extensible KV cache (``gpu_worker``'s names).

    Segments are not padded to a granule (the worker keeps its own copy of the config, as a worker process
    does), nothing registers the memory, a worker's cross-rank minimum is its own count (the engine core takes
    the minimum of all ranks, in vLLM's ``finalize_extensible_kv_cache``), and ``extend_kv_cache`` commits
    the blocks as the driver does: each backing buffer's bytes per block times the committed count, rounded up
    to whole 2 MiB granules (``physical_bytes``), mapped on the worker's fake device outside the caching
    allocator: the device's used memory holds them, ``torch.cuda.memory_reserved`` does not. As vLLM's does,
    it sets the runner's config's block count and leaves its tensors describing the reservation.
    """
    import copy

    import fake_cuda
    import torch

    def extend_kv_cache(runner: Any, kv_cache_config: Any, num_blocks: int) -> None:
        reserved = runner.kv_cache_config.num_blocks
        sizes = [tensor.size // reserved * num_blocks for tensor in runner.kv_cache_config.kv_cache_tensors]
        physical = sum(-(-size // GRANULE) * GRANULE for size in sizes)
        runner.committed = fake_cuda.map_outside_allocator(physical, runner.device)
        runner.allocated_bytes = sum(sizes)
        runner.extensible_kv_cache.physical_bytes = physical
        runner.extensible_kv_cache.bytes_per_block = sum(sizes) // num_blocks
        runner.kv_cache_config.num_blocks = num_blocks

    torch.accelerator.current_device_index = lambda: 0
    gpu_worker.pad_kv_cache_segments = lambda kv_cache_config, *args, **kwargs: copy.deepcopy(kv_cache_config)
    gpu_worker.granule_size = lambda device: GRANULE
    gpu_worker.registers_kv_cache_memory = lambda vllm_config: False
    gpu_worker._min_across_ranks = lambda value: value
    gpu_worker.extend_kv_cache = extend_kv_cache


def weights_and_warmup(worker: Any, weights_bytes: int, activation_bytes: int) -> None:
    """What loading and warming up take from the caching allocator on ``worker``'s fake device: the weights, kept;
    a warmup forward's activations, freed; then ``empty_cache``, as vLLM's ``measure_kv_cache_blocks`` empties
    torch's cache before it reads the free memory. The weights' segment is rounded up to 2 MiB (cache slack)."""
    import fake_cuda
    import torch

    torch.cuda.set_device(worker.device)
    worker.model_runner.weights = fake_cuda.empty(weights_bytes)
    fake_cuda.empty(activation_bytes).free()
    torch.cuda.empty_cache()


def triton_as_on_a_gpu_host(gpu_worker: Any) -> None:
    """Let vLLM's CPU platform and ``Worker`` check for Triton and find it, as on every CUDA host.

    vLLM 0.34 refuses an x86 CPU platform without Triton (``CpuPlatform.check_and_update_config``) and
    a ``Worker`` without it (``gpu_worker.HAS_TRITON``); its CPU wheel brings none, and no kernel runs
    here (the model runner is :class:`CpuModelRunner`). Only those two checks see the flag: modules
    already imported built their kernels' placeholders. vLLM 0.33 checks neither.
    """
    import vllm.triton_utils

    vllm.triton_utils.HAS_TRITON = gpu_worker.HAS_TRITON = True


def cpu_init_device(self: Any) -> None:
    import torch
    from vllm.v1.worker.utils import request_memory

    self.device = torch.device("cuda", self.local_rank)
    torch.cuda.set_device(self.local_rank)
    free, total = torch.cuda.mem_get_info(self.local_rank)
    self.init_snapshot = SimpleNamespace(free_memory=free, total_memory=total)
    self.requested_memory = request_memory(self.init_snapshot, self.cache_config, 0)
    self.model_runner = CpuModelRunner(self.vllm_config)
    self.model_runner.device = self.device


def make_config(model: str, dp_rank: int, spec_tokens: int = 0, *, dp: int = 2, tp: int = 2, block_size: int = 16,
            **cache: Any) -> Any:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    speculative = None
    if spec_tokens:
        speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens,
                                        prompt_lookup_max=2, prompt_lookup_min=1)
    return VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=512, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=block_size, gpu_memory_utilization=0.5, **cache),
        parallel_config=ParallelConfig(data_parallel_size=dp, tensor_parallel_size=tp, data_parallel_rank=dp_rank),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=512,
                                         is_encoder_decoder=False),
        speculative_config=speculative,
    )


def layer_specs(tp: int, block_size: int = 16, hybrid: bool = True) -> dict[str, Any]:
    """Four layers, full and sliding-window attention in turn (all full when not ``hybrid``); 4 KV heads split
    over ``tp`` ranks."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    heads = 4 // tp
    return {f"model.layers.{i}.self_attn.attn":
            FullAttentionSpec(block_size, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16)
            if i % 2 == 0 or not hybrid else
            SlidingWindowSpec(block_size, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16, sliding_window=64)
            for i in range(4)}


def plan_kv(config: Any, available: list[int], hybrid: bool = True) -> list[Any]:
    """What ``EngineCore._initialize_kv_caches`` does with the workers' specs and memory."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    specs = [layer_specs(config.parallel_config.tensor_parallel_size, config.cache_config.block_size, hybrid)
             for _ in available]
    resolve_kv_cache_layout(config, [["LBNHC"]] * len(available), [s for spec in specs for s in spec.values()])
    groups = get_global_kv_cache_groups(config, specs)
    kv_cache_configs = get_kv_cache_configs(config, specs, available, groups)
    config.cache_config.num_gpu_blocks = kv_cache_configs[0].num_blocks
    return kv_cache_configs


def serve(scheduler: Any, prompts: dict[str, int], max_tokens: int, drafts: int, stagger: int = 0,
           worker: Any = None) -> list[dict[str, Any]]:
    """The engine core's loop: schedule, the model's output (from ``worker.execute_model`` when given, as
    vLLM's executor runs it; else built the same way here), then ``update_from_output``.

    Every prompt arrives before the first step, or, with ``stagger``, the i-th before step ``i × stagger``.
    Returns, per step, what vLLM itself says of it: requests and tokens scheduled, draft tokens
    scheduled, requests preempted, ``kv_cache_manager.usage`` right after ``schedule()``, requests
    finished, and the ``SchedulerStats.kv_cache_usage`` that ``update_from_output`` hands the front end's
    stat loggers (None unless the scheduler has ``log_stats``).
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import Request

    pending = list(prompts.items())
    steps: list[dict[str, Any]] = []
    model = CpuModelRunner(None)
    while pending or scheduler.has_requests():
        while pending and (not stagger or len(prompts) - len(pending) <= len(steps) // stagger):
            name, length = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            scheduler.add_request(Request(name, list(range(1, length + 1)), params, None))
        output = scheduler.schedule()
        steps.append({"num_seqs": len(output.num_scheduled_tokens), "num_tokens": output.total_num_scheduled_tokens,
                      "drafts": sum(map(len, output.scheduled_spec_decode_tokens.values())),
                      "new": len(output.scheduled_new_reqs), "preempted": len(output.preempted_req_ids or ()),
                      "usage": scheduler.kv_cache_manager.usage})
        result = worker.execute_model(output) if worker is not None else model.execute_model(output)
        outputs = scheduler.update_from_output(output, result).values()
        stats = [eco.scheduler_stats for eco in outputs if eco.scheduler_stats is not None]
        steps[-1]["stats_usage"] = stats[0].kv_cache_usage if stats else None
        steps[-1]["finished"] = sum(out.finish_reason is not None for eco in outputs for out in eco.outputs)
        if drafts:
            running = [request.request_id for request in scheduler.running]
            scheduler.update_draft_token_ids(DraftTokenIds(running, [[7] * drafts for _ in running]))
    return steps
