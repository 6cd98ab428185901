"""Mirror of ``vllm/config``: the fields the worker, the engine core and the adapter read."""

from dataclasses import dataclass, field

import torch


@dataclass
class ModelConfig:
    model: str
    dtype: torch.dtype = torch.bfloat16
    max_model_len: int = 4096
    enforce_eager: bool = False
    num_hidden_layers: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 128
    sliding_window_layers: int = 0
    """Layers (of ``num_hidden_layers``) with sliding-window attention: a second KV cache group."""


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None
    cache_dtype: str = "auto"
    num_gpu_blocks: int | None = None


@dataclass
class ParallelConfig:
    """``world_size`` is one engine's (TP × PP); data-parallel engines each have their own."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    worker_cls: str = "vllm.v1.worker.gpu_worker.Worker"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size_across_dp(self) -> int:
        return self.world_size * self.data_parallel_size


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int = 0


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = None
