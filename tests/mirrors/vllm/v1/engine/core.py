"""Mirror of ``vllm/v1/engine/core.py`` (``EngineCore``): plugins, executor, KV sizing, ``step``.

``_initialize_kv_caches``: the workers' available memory → ``num_blocks = available // bytes per
block`` (the minimum over workers) → ``cache_config.num_gpu_blocks`` → one KV tensor per layer →
``initialize_from_config`` → ``compile_or_warm_up_model``.
"""

from vllm.plugins import load_general_plugins
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
from vllm.v1.metrics.stats import IterationStats


class EngineCore:
    def __init__(self, vllm_config, executor_class, log_stats: bool = True):
        load_general_plugins()
        self.vllm_config = vllm_config
        self.model_executor = executor_class(vllm_config)
        num_gpu_blocks = self._initialize_kv_caches(vllm_config)
        self.scheduler = Scheduler(vllm_config, num_gpu_blocks)

    def _initialize_kv_caches(self, vllm_config) -> int:
        bytes_per_block = self.model_executor.get_kv_cache_specs()
        available = self.model_executor.determine_available_memory()
        num_blocks = min(memory // per_block for memory, per_block in zip(available, bytes_per_block, strict=True))
        layers = vllm_config.model_config.num_hidden_layers
        per_layer = bytes_per_block[0] // layers * num_blocks
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[
            KVCacheTensor(size=per_layer, layers=[f"model.layers.{i}.self_attn.attn"]) for i in range(layers)])
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.model_executor.initialize_from_config([config])
        self.model_executor.compile_or_warm_up_model()
        return num_blocks

    def step(self):
        if not self.scheduler.has_requests():
            return [], None, None
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_executor.execute_model(scheduler_output)
        finished = self.scheduler.update_from_output(scheduler_output, model_output)
        iteration_stats = IterationStats()
        iteration_stats.num_preempted_reqs = self.scheduler.num_preempted
        return finished, self.scheduler.make_stats(), iteration_stats

    def shutdown(self):
        self.model_executor.shutdown()
