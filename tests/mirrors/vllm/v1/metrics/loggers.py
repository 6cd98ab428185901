"""Mirror of ``vllm/v1/metrics/loggers.py``: ``StatLoggerBase`` and the plugin factory loader."""

from abc import ABC, abstractmethod

from vllm.plugins import STAT_LOGGER_PLUGINS_GROUP, load_plugins_by_group


class StatLoggerBase(ABC):
    @abstractmethod
    def __init__(self, vllm_config, engine_index: int = 0): ...

    @abstractmethod
    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0): ...

    @abstractmethod
    def log_engine_initialized(self): ...

    def log(self):  # noqa: B027
        pass


def load_stat_logger_plugin_factories():
    factories = []
    for name, plugin_class in load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP).items():
        if not isinstance(plugin_class, type) or not issubclass(plugin_class, StatLoggerBase):
            raise TypeError(f"Stat logger plugin {name!r} must be a subclass of StatLoggerBase")
        factories.append(plugin_class)
    return factories
