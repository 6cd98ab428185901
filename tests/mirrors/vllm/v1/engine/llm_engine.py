"""Mirror of ``vllm/v1/engine/llm_engine.py``: an in-process engine core and its stat loggers.

Each step's scheduler and iteration stats go to every stat logger's ``record`` (upstream: through
the output processor); ``log_engine_initialized`` runs once the KV cache is sized.
"""

from vllm.v1.core.sched.scheduler import Request
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.uniproc_executor import UniProcExecutor


class LLMEngine:
    def __init__(self, vllm_config, stat_loggers=None):
        self.vllm_config = vllm_config
        self.engine_core = EngineCore(vllm_config, UniProcExecutor)
        self.stat_loggers = [factory(vllm_config, 0) for factory in stat_loggers or []]
        for logger in self.stat_loggers:
            logger.log_engine_initialized()

    def add_request(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        self.engine_core.scheduler.add_request(Request(request_id, prompt_len, max_tokens))

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.scheduler.has_requests()

    def step(self):
        finished, scheduler_stats, iteration_stats = self.engine_core.step()
        for logger in self.stat_loggers:
            logger.record(scheduler_stats, iteration_stats, engine_idx=0)
        return finished

    def shutdown(self):
        self.engine_core.shutdown()
