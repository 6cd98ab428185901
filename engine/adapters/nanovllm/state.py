"""What the nano-vllm hooks share in one process: the module names they patch, each rank's state, the
scheduler rank 0 reads, and the one guard that turns the whole adapter off on a fault of its own."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from ...monitor import Monitor
from ..hooks import Guard

MODEL_RUNNER = "nanovllm.engine.model_runner"
SCHEDULER = "nanovllm.engine.scheduler"
LLM_ENGINE = "nanovllm.engine.llm_engine"
RANK_ATTRIBUTE = "_memwatch_rank"

guard = Guard("nano-vllm")
"""One guard for the whole adapter: a fault in any of its hooks turns all of them off."""


class Rank:
    """memwatch's state for one ``ModelRunner``: its monitor and the phases it has open."""

    def __init__(self, monitor: Monitor, rank: int) -> None:
        self.monitor = monitor
        self.rank = rank
        self.phases = ExitStack()
        self.load_phase = ExitStack()
        self.in_startup = 0
        self.serving = False


class Process:
    """What rank 0's steps need from this process's scheduler, and the run ids used here."""

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.preemptions = 0
        self.run_ids: set[str] = set()
        self.lead: Rank | None = None
        """Rank 0 of this process, which records the requests the scheduler sees."""


process = Process()
