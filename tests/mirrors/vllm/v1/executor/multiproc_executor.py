"""Mirror of ``vllm/v1/executor/multiproc_executor.py``: one worker per rank of this engine (TP × PP).

Upstream runs each worker in a process of its own; here they run in the engine core's process, each
on its own simulated device (``fake_cuda`` switches device around every call, as a worker's own
process would already be on it). Worker ``rank`` is the rank inside this engine, from 0, as upstream.
"""

import torch

from vllm.v1.executor.uniproc_executor import UniProcExecutor


class MultiprocExecutor(UniProcExecutor):
    def _world_size(self) -> int:
        return self.vllm_config.parallel_config.world_size

    def collective_rpc(self, method: str, args: tuple = ()):
        results = []
        for worker in self.workers:
            torch.cuda.set_device(worker.rpc_rank)
            results.append(worker.execute_method(method, *args))
        return results

    def initialize_from_config(self, kv_cache_configs) -> None:
        for worker, config in zip(self.workers, kv_cache_configs, strict=True):
            torch.cuda.set_device(worker.rpc_rank)
            worker.execute_method("initialize_from_config", config)
