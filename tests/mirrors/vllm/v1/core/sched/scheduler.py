"""Mirror of ``vllm/v1/core/sched/scheduler.py`` reduced to what KV pressure needs.

Running requests first: one token each, plus ``num_speculative_tokens`` draft tokens when
speculative decoding is on (all accepted here); when a request needs a block and none is free, the
last running request is preempted (its blocks freed, recomputed later), as 0.33.0 does without
priorities. Waiting requests are prefilled whole, only in steps that preempted nothing: a new
request goes out as ``scheduled_new_reqs``, a preempted one as a resumed cached request. Blocks come
from ``kv_cache_manager.block_pool`` (``num_gpu_blocks``, ``get_num_free_blocks``; the null block is
never handed out). ``make_stats`` returns None unless ``log_stats``.
"""

from collections import deque

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.metrics.stats import SchedulerStats


class Request:
    def __init__(self, request_id: str, prompt_len: int, max_tokens: int):
        self.request_id = request_id
        self.num_tokens = prompt_len
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.max_tokens = max_tokens
        self.blocks = 0
        self.num_preemptions = 0
        self.is_new = True


class BlockPool:
    def __init__(self, num_gpu_blocks: int):
        self.num_gpu_blocks = num_gpu_blocks
        self.num_free = num_gpu_blocks - 1  # the null block

    def get_num_free_blocks(self) -> int:
        return self.num_free

    def get_usage(self) -> float:
        return 1.0 - self.num_free / (self.num_gpu_blocks - 1)


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int):
        self.block_pool = BlockPool(num_gpu_blocks)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()


class Scheduler:
    def __init__(self, vllm_config, kv_cache_config, structured_output_manager=None, block_size: int = 16,
                 log_stats: bool = False):
        self.vllm_config = vllm_config
        self.block_size = block_size
        self.log_stats = log_stats
        speculative = vllm_config.speculative_config
        self.num_spec_tokens = speculative.num_speculative_tokens if speculative else 0
        self.kv_cache_manager = KVCacheManager(kv_cache_config.num_blocks)
        self.pool = self.kv_cache_manager.block_pool
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
            tokens = 1 + self.num_spec_tokens
            need = self._blocks_for(request.num_computed_tokens + tokens) - request.blocks
            while need > self.pool.num_free:
                victim = self.running.pop()
                self.pool.num_free += victim.blocks
                victim.blocks, victim.num_computed_tokens = 0, 0
                victim.num_preemptions += 1
                self.waiting.appendleft(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if request.request_id in preempted:
                continue
            self.pool.num_free -= need
            request.blocks += need
            scheduled[request.request_id] = tokens
        new, resumed = [], set()
        while self.waiting and not preempted:
            request = self.waiting[0]
            need = self._blocks_for(request.num_tokens)
            if need > self.pool.num_free:
                break
            self.waiting.popleft()
            self.pool.num_free -= need
            request.blocks = need
            scheduled[request.request_id] = request.num_tokens
            if request.is_new:
                new.append(NewRequestData(request.request_id))
                request.is_new = False
            else:
                resumed.add(request.request_id)
            self.running.append(request)
        self.num_preempted = len(preempted)
        cached = [request for request in self.running
                  if request.request_id in scheduled and request.request_id not in {r.req_id for r in new}]
        spec = {req_id: [0] * self.num_spec_tokens for req_id, tokens in scheduled.items()
                if self.num_spec_tokens and tokens == 1 + self.num_spec_tokens and req_id not in resumed}
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[request.request_id for request in cached], resumed_req_ids=resumed,
                num_computed_tokens=[request.num_computed_tokens for request in cached],
                num_output_tokens=[request.num_output_tokens for request in cached]),
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens=spec, preempted_req_ids=preempted)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_output: dict) -> list[str]:
        finished = []
        for request in list(self.running):
            tokens = scheduler_output.num_scheduled_tokens.get(request.request_id)
            if tokens is None:
                continue
            request.num_computed_tokens += tokens
            generated = tokens if request.request_id in scheduler_output.scheduled_spec_decode_tokens else 1
            request.num_tokens += generated
            request.num_output_tokens += generated
            if request.num_output_tokens >= request.max_tokens:
                self.running.remove(request)
                self.pool.num_free += request.blocks
                finished.append(request.request_id)
        return finished

    def make_stats(self) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        return SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                              kv_cache_usage=self.kv_cache_manager.usage)

    def shutdown(self) -> None:
        pass
