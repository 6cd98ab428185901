"""Mirror of ``vllm/v1/metrics/stats.py``: ``SchedulerStats`` and ``IterationStats`` fields used here."""

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


class IterationStats:
    def __init__(self):
        self.num_preempted_reqs = 0
