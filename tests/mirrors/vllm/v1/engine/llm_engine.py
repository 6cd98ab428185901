"""Mirror of ``vllm/v1/engine/llm_engine.py``: an in-process engine core and its stat loggers.

As upstream, stat loggers exist only with ``log_stats`` (offline ``LLM`` turns it off by default):
each step's scheduler and iteration stats go to every logger's ``record``, and
``log_engine_initialized`` runs once the KV cache is sized. ``LLMEngine`` does not load stat logger
plugins; ``AsyncLLM`` does (``async_llm.py``).
"""

from vllm.v1.core.sched.scheduler import Request
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.uniproc_executor import UniProcExecutor


class LLMEngine:
    def __init__(self, vllm_config, log_stats: bool = False, stat_loggers=None, executor_class=UniProcExecutor):
        self.vllm_config = vllm_config
        self.log_stats = log_stats
        self.engine_core = EngineCore(vllm_config, executor_class, log_stats=log_stats)
        self.stat_loggers = []
        if log_stats:
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
