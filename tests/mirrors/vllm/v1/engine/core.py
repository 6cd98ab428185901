"""Mirror of ``vllm/v1/engine/core.py`` (``EngineCore``): plugins, executor, KV sizing, ``step``.

``_initialize_kv_caches``: the workers' KV specs and available memory → cache groups (full
attention; sliding-window layers in groups of as many layers as the full-attention groups, as
``kv_cache_planning`` does for one page size) → ``bytes per block`` = the largest group's pages →
``num_blocks = available // bytes per block`` (the minimum over workers) → one backing buffer of
``bytes per block × num_blocks``, named by one ``KVCacheTensor`` per group that each carry the
whole size → ``initialize_from_config`` → ``compile_or_warm_up_model``. The scheduler gets
``log_stats``; a step's scheduler stats are None without it.
"""

from vllm.plugins import load_general_plugins
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.metrics.stats import IterationStats


def _groups(layer_kinds: dict[str, str]) -> list[KVCacheGroupSpec]:
    by_kind: dict[str, list[str]] = {}
    for name, kind in layer_kinds.items():
        by_kind.setdefault(kind, []).append(name)
    size = min(len(names) for names in by_kind.values())
    groups = []
    for kind, names in by_kind.items():
        assert len(names) % size == 0, "the mirror groups layer kinds of divisible counts only"
        groups.extend(KVCacheGroupSpec(names[i:i + size], kind) for i in range(0, len(names), size))
    return groups


class EngineCore:
    def __init__(self, vllm_config, executor_class, log_stats: bool = True):
        load_general_plugins()
        self.vllm_config = vllm_config
        self.log_stats = log_stats
        self.model_executor = executor_class(vllm_config)
        kv_cache_config = self._initialize_kv_caches(vllm_config)
        self.scheduler = Scheduler(vllm_config, kv_cache_config, None, vllm_config.cache_config.block_size,
                                   log_stats=log_stats)

    def _initialize_kv_caches(self, vllm_config) -> KVCacheConfig:
        specs = self.model_executor.get_kv_cache_specs()
        available = self.model_executor.determine_available_memory()
        layer_kinds, page_bytes = specs[0]
        groups = _groups(layer_kinds)
        bytes_per_block = max(len(group.layer_names) for group in groups) * page_bytes
        num_blocks = min(memory // bytes_per_block for memory in available)
        size = bytes_per_block * num_blocks
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups, kv_cache_tensors=[
            KVCacheTensor(size=size, layers=group.layer_names, layer_stride=page_bytes * num_blocks,
                          block_stride=page_bytes) for group in groups])
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.model_executor.initialize_from_config([config] * len(available))
        self.model_executor.compile_or_warm_up_model()
        return config

    def step(self):
        if not self.scheduler.has_requests():
            return [], None, None
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_executor.execute_model(scheduler_output)
        finished = self.scheduler.update_from_output(scheduler_output, model_output)
        iteration_stats = None
        if self.log_stats:
            iteration_stats = IterationStats()
            iteration_stats.num_preempted_reqs = self.scheduler.num_preempted
        return finished, self.scheduler.make_stats(), iteration_stats

    def shutdown(self):
        self.model_executor.shutdown()
        self.scheduler.shutdown()
