"""Mirror of ``vllm/plugins/__init__.py``: entry-point groups, ``VLLM_PLUGINS`` filter, load once per process.

As upstream, a plugin whose entry point fails to load is logged (``logger.exception``) and skipped;
the general plugins are then called, once per process.
"""

import logging
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"
STAT_LOGGER_PLUGINS_GROUP = "vllm.stat_logger_plugins"

plugins_loaded = False


def load_plugins_by_group(group: str) -> dict[str, Callable[[], Any]]:
    allowed = os.environ.get("VLLM_PLUGINS")
    allowed_plugins = None if allowed is None else allowed.split(",")
    plugins = {}
    for plugin in entry_points(group=group):
        if allowed_plugins is None or plugin.name in allowed_plugins:
            try:
                plugins[plugin.name] = plugin.load()
            except Exception:
                logger.exception("Failed to load plugin %s", plugin.name)
    return plugins


def load_general_plugins():
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    for func in load_plugins_by_group(group=DEFAULT_PLUGINS_GROUP).values():
        func()
