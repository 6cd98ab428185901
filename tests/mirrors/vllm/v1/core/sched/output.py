"""Mirror of ``vllm/v1/core/sched/output.py``: the fields of ``SchedulerOutput`` the worker reads."""

from dataclasses import dataclass, field


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None
