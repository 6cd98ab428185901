"""Mirror of ``vllm/v1/worker/worker_base.py``: ``WorkerWrapperBase.init_worker`` loads the general
plugins, then resolves ``parallel_config.worker_cls`` by qualified name and builds the worker."""

import importlib

from vllm.plugins import load_general_plugins


class WorkerWrapperBase:
    def __init__(self, rpc_rank: int = 0):
        self.rpc_rank = rpc_rank
        self.worker = None

    def init_worker(self, all_kwargs: list[dict]) -> None:
        kwargs = all_kwargs[self.rpc_rank]
        self.vllm_config = kwargs["vllm_config"]
        load_general_plugins()
        module_name, _, class_name = self.vllm_config.parallel_config.worker_cls.rpartition(".")
        worker_class = getattr(importlib.import_module(module_name), class_name)
        self.worker = worker_class(**kwargs)

    def execute_method(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)
