"""Mirror of ``vllm/v1/core/sched/scheduler.py`` reduced to what KV pressure needs.

Running requests first, one token each; when a request needs a block and none is free, the last
running request is preempted (its blocks freed, recomputed later), as 0.33.0 does without priorities.
Waiting requests are prefilled whole, only in steps that preempted nothing. Usage is
``1 − free / (num_gpu_blocks − 1)``: the null block is never handed out.
"""

from collections import deque

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.stats import SchedulerStats


class Request:
    def __init__(self, request_id: str, prompt_len: int, max_tokens: int):
        self.request_id = request_id
        self.num_tokens = prompt_len
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.max_tokens = max_tokens
        self.blocks = 0


class Scheduler:
    def __init__(self, vllm_config, num_gpu_blocks: int):
        self.block_size = vllm_config.cache_config.block_size
        self.usable_blocks = num_gpu_blocks - 1
        self.free_blocks = self.usable_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preempted = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def schedule(self) -> SchedulerOutput:
        scheduled: dict[str, int] = {}
        preempted: set[str] = set()
        for request in list(self.running):
            if request.request_id in preempted:
                continue
            need = self._blocks_for(request.num_computed_tokens + 1) - request.blocks
            while need > self.free_blocks:
                victim = self.running.pop()
                self.free_blocks += victim.blocks
                victim.blocks, victim.num_computed_tokens = 0, 0
                self.waiting.appendleft(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if request.request_id in preempted:
                continue
            self.free_blocks -= need
            request.blocks += need
            scheduled[request.request_id] = 1
        while self.waiting and not preempted:
            request = self.waiting[0]
            need = self._blocks_for(request.num_tokens)
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            self.free_blocks -= need
            request.blocks = need
            scheduled[request.request_id] = request.num_tokens
            self.running.append(request)
        self.num_preempted = len(preempted)
        return SchedulerOutput(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                               preempted_req_ids=preempted)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_output: dict) -> list[str]:
        finished = []
        for request in list(self.running):
            tokens = scheduler_output.num_scheduled_tokens.get(request.request_id)
            if tokens is None:
                continue
            request.num_computed_tokens += tokens
            request.num_tokens += 1
            request.num_output_tokens += 1
            if request.num_output_tokens == request.max_tokens:
                self.running.remove(request)
                self.free_blocks += request.blocks
                finished.append(request.request_id)
        return finished

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                              kv_cache_usage=1 - self.free_blocks / self.usable_blocks)
