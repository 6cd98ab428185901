"""The SGLang adapter's state for the one rank of this process, shared by its runner, sizing and scheduler parts."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from ...monitor import Monitor
from ..hooks import Guard

guard = Guard("SGLang")


class Rank:
    """memwatch's state for the one SGLang rank of this process."""

    def __init__(self, monitor: Monitor, identity: Any) -> None:
        self.monitor = monitor
        self.identity = identity
        self.phases = ExitStack()
        self.serving = False
        self.sizing: dict[str, Any] = {}
        self.profiling = False
        self.resizing = False
        self.sized_on: tuple[int, int, int, int, int] | None = None
        self.records_requests = False
        self.evictable = 0
        self.evictable_at = 0
        self.configurator: Any = None
        """SGLang's ``KVCacheConfigurator`` of the target model, once it sized the pool."""


class _Process:
    rank: Rank | None = None


process = _Process()


def current() -> Rank | None:
    """This process's rank, while the adapter is on."""
    return process.rank if guard.active else None


def _mine(runner: Any) -> Rank | None:
    """The rank state when ``runner`` is this process's target runner (not a draft model's)."""
    state = current()
    return state if state is not None and not getattr(runner, "is_draft_worker", False) else None

