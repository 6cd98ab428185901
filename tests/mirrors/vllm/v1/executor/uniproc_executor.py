"""Mirror of ``vllm/v1/executor/uniproc_executor.py``: the single worker lives in the engine core process."""

from vllm.v1.worker.worker_base import WorkerWrapperBase


class UniProcExecutor:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.workers = [self._make_worker(rank) for rank in range(self._world_size())]
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def _world_size(self) -> int:
        return 1

    def _make_worker(self, rank: int) -> WorkerWrapperBase:
        worker = WorkerWrapperBase(rpc_rank=rank)
        worker.init_worker(all_kwargs=[{
            "vllm_config": self.vllm_config, "local_rank": rank, "rank": rank,
            "distributed_init_method": "tcp://127.0.0.1:0", "is_driver_worker": rank == 0,
        }] * (rank + 1))
        return worker

    def collective_rpc(self, method: str, args: tuple = ()):
        return [worker.execute_method(method, *args) for worker in self.workers]

    def determine_available_memory(self) -> list[int]:
        return self.collective_rpc("determine_available_memory")

    def get_kv_cache_specs(self) -> list:
        return self.collective_rpc("get_kv_cache_spec")

    def initialize_from_config(self, kv_cache_configs) -> None:
        for worker, config in zip(self.workers, kv_cache_configs, strict=True):
            worker.execute_method("initialize_from_config", config)

    def compile_or_warm_up_model(self) -> None:
        self.collective_rpc("compile_or_warm_up_model")

    def execute_model(self, scheduler_output):
        return self.collective_rpc("execute_model", args=(scheduler_output,))[0]

    def shutdown(self) -> None:
        self.collective_rpc("shutdown")
