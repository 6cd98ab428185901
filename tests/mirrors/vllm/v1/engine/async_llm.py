"""Mirror of ``vllm/v1/engine/async_llm.py``: which stat loggers a served engine gets, and ``log_stats``.

``AsyncLLM.__init__`` adds the ``vllm.stat_logger_plugins`` factories to the ones it was given and
turns ``log_stats`` on when there is any (``log_stats = log_stats or has_custom_loggers``). The
engine itself is the in-process mirror of ``LLMEngine``.
"""

from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories


class AsyncLLM(LLMEngine):
    def __init__(self, vllm_config, log_stats: bool, stat_loggers=None, **kwargs):
        custom_stat_loggers = list(stat_loggers or [])
        custom_stat_loggers.extend(load_stat_logger_plugin_factories())
        super().__init__(vllm_config, log_stats=log_stats or bool(custom_stat_loggers),
                         stat_loggers=custom_stat_loggers, **kwargs)
