"""Mirror of ``vllm/v1/worker/gpu_worker.py`` (``Worker``): the memory profile and KV budget of 0.33.0.

``init_device`` snapshots free/total memory and requests ``ceil(total × gpu_memory_utilization)``;
``determine_available_memory`` profiles one forward of ``max_num_batched_tokens`` between an
``empty_cache`` and a peak reset, then returns ``requested − (total consumed + transient peak) −
CUDA-graph estimate``; with ``kv_cache_memory_bytes`` set it still runs the profiling forward (it
compiles for the batch size upstream) and returns that size. ``initialize_from_config`` allocates
the one backing buffer all ``KVCacheTensor`` entries share (``vllm/v1/worker/utils.py``,
``allocate_kv_cache``). Weights are ``WEIGHT_BYTES``; a forward takes ``tokens × 4 KiB`` of
activations; graphs ``CUDAGRAPH_BYTES`` (estimated exactly).
"""

import math

import fake_cuda
import torch

WEIGHT_BYTES = 20 * 2**20
CUDAGRAPH_BYTES = 4 * 2**20
ACTIVATION_BYTES_PER_TOKEN = 4096


class MemorySnapshot:
    def __init__(self, device=None):
        self.free_memory, self.total_memory = torch.cuda.mem_get_info(device)


class _ModelRunner:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.model_memory_usage = 0

    def load_model(self, load_dummy_weights: bool = False):
        self.weights = fake_cuda.empty(WEIGHT_BYTES)
        self.model_memory_usage = WEIGHT_BYTES

    def forward(self, num_tokens: int):
        fake_cuda.empty(num_tokens * ACTIVATION_BYTES_PER_TOKEN).free()


class Worker:
    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False):
        self.vllm_config = vllm_config
        self.cache_config = vllm_config.cache_config
        self.model_config = vllm_config.model_config
        self.parallel_config = vllm_config.parallel_config
        self.local_rank = local_rank
        self.rank = rank

    def init_device(self):
        self.device = torch.device(f"cuda:{self.local_rank}")
        torch.cuda.set_device(self.device)
        torch.cuda.empty_cache()
        self.init_snapshot = MemorySnapshot(self.device)
        self.requested_memory = math.ceil(self.init_snapshot.total_memory * self.cache_config.gpu_memory_utilization)
        self.model_runner = _ModelRunner(self.vllm_config)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        self.model_runner.load_model(load_dummy_weights=load_dummy_weights)

    def determine_available_memory(self) -> int:
        if kv_cache_memory_bytes := self.cache_config.kv_cache_memory_bytes:
            self.model_runner.forward(self.vllm_config.scheduler_config.max_num_batched_tokens)
            return kv_cache_memory_bytes
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.model_runner.forward(self.vllm_config.scheduler_config.max_num_batched_tokens)
        torch.cuda.empty_cache()
        stats = torch.cuda.memory_stats()
        transient_peak_headroom = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        self.total_consumed = self.init_snapshot.free_memory - MemorySnapshot(self.device).free_memory
        cudagraph_memory_estimate = 0 if self.model_config.enforce_eager else CUDAGRAPH_BYTES
        self.cudagraph_memory_estimate = cudagraph_memory_estimate
        self.peak_activation_memory = transient_peak_headroom + cudagraph_memory_estimate
        non_kv_cache_memory = self.total_consumed + transient_peak_headroom
        self.available_kv_cache_memory_bytes = self.requested_memory - non_kv_cache_memory - cudagraph_memory_estimate
        return int(self.available_kv_cache_memory_bytes)

    def get_kv_cache_spec(self) -> tuple[dict[str, str], int]:
        """Each layer's attention kind (the last ``sliding_window_layers`` slide), and one page's bytes:
        block_size × KV heads per rank × (K + V head size) × dtype size."""
        model = self.model_config
        layers = model.num_hidden_layers
        kinds = {f"model.layers.{i}.self_attn.attn":
                 "sliding_window" if i >= layers - model.sliding_window_layers else "full_attention"
                 for i in range(layers)}
        heads = model.num_key_value_heads // self.parallel_config.tensor_parallel_size
        return kinds, self.cache_config.block_size * heads * 2 * model.head_dim * model.dtype.itemsize

    def initialize_from_config(self, kv_cache_config) -> None:
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        sizes = {tensor.size for tensor in kv_cache_config.kv_cache_tensors}
        assert len(sizes) == 1, "KV cache tensors must share one backing allocation."
        self.kv_cache = fake_cuda.empty(sizes.pop())

    def compile_or_warm_up_model(self):
        if not self.model_config.enforce_eager:
            self.graph_pool = fake_cuda.empty(CUDAGRAPH_BYTES)
        return {}

    def execute_model(self, scheduler_output):
        if scheduler_output.total_num_scheduled_tokens:
            self.model_runner.forward(scheduler_output.total_num_scheduled_tokens)
        return {req_id: 7 for req_id in scheduler_output.num_scheduled_tokens}

    def shutdown(self) -> None:
        pass
