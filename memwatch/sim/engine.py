"""The simulated engine: nano-vllm's ``LLMEngine`` driving every rank's runner in lockstep.

Ranks run in one process, one after another within each phase and each step, on one virtual clock:
what matters is that each rank has its own device and its own Monitor writing its own ring. As in
nano-vllm, only rank 0 schedules; every rank runs the same forward of each step, and rank 0 alone
reports the step's kind, sequences, tokens and KV blocks, the load (requests running and waiting,
the KV blocks the running ones still need, read after the forward as nano-vllm's adapter reads
them), and the preemptions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from memwatch.sim.blocks import BlockManager
from memwatch.sim.clock import VirtualClock
from memwatch.sim.config import CostModel, EngineConfig
from memwatch.sim.faults import ExtraRequest
from memwatch.sim.runner import RankRunner
from memwatch.sim.scheduler import Scheduler
from memwatch.sim.sequence import Sequence
from memwatch.sim.workload import Request


@dataclass
class ServeStats:
    """What the serving loop saw; filled in as it goes, so it is meaningful after a crash too."""

    requests: int = 0
    finished: int = 0
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    max_resident_requests: int = 0
    max_kv_blocks_used: int = 0


class SimulatedEngine:
    def __init__(self, engine: EngineConfig, cost: CostModel, runners: list[RankRunner], clock: VirtualClock,
                 model_config: str | None = None) -> None:
        self.engine = engine
        self.cost = cost
        self.runners = runners
        self.clock = clock
        self.stats = ServeStats()
        self.model_config = model_config
        """What the run records as its ``model_config``: where its model was read from when that was a file (so
        that ``plan --run`` reads it again there, offline), else the model's name."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Every rank enters the phase together and leaves it together."""
        with ExitStack() as stack:
            for runner in self.runners:
                stack.enter_context(runner.phase(name))
            yield

    def start(self) -> None:
        """``ModelRunner.__init__`` on every rank: load, warmup, KV cache, CUDA graphs."""
        engine, cost, spec = self.engine, self.cost, self.runners[0].spec
        for runner in self.runners:
            runner.monitor.set_config(
                gpu_memory_utilization=engine.gpu_memory_utilization, block_size=engine.block_size,
                max_num_batched_tokens=engine.max_num_batched_tokens, max_num_seqs=engine.max_num_seqs,
                max_model_len=engine.max_model_len, tensor_parallel_size=engine.tensor_parallel_size,
                dtype=spec.dtype, enforce_eager=engine.enforce_eager, attention=engine.attention,
                model_config=self.model_config or spec.name,
            )
            runner.setup_faults()
        with self.phase("load"):
            for runner in self.runners:
                runner.load_weights()
            self.clock.advance(spec.weight_bytes(tp=engine.tensor_parallel_size) / cost.load_bytes_per_s)
        with self.phase("warmup"):
            for runner in self.runners:
                runner.warmup()
            num_seqs, seq_len = self.runners[0].warmup_shape()
            self.clock.advance(num_seqs * seq_len / cost.prefill_tokens_per_s)
        with self.phase("kv_alloc"):
            for runner in self.runners:
                runner.allocate_kv_cache()
        if not engine.enforce_eager:
            with self.phase("cudagraph"):
                for runner in self.runners:
                    captured = runner.capture_cudagraph()
                self.clock.advance(len(captured) * cost.graph_capture_s)

    def serve(self, requests: list[Request]) -> ServeStats:
        """Serve every request to completion; raises what a real engine would die of."""
        engine, stats = self.engine, self.stats
        lead = self.runners[0]
        if lead.kv_sizing is None:
            raise RuntimeError("SimulatedEngine.start() must run before serve()")
        manager = BlockManager(lead.kv_sizing.num_blocks, engine.block_size)
        scheduler = Scheduler(manager, max_num_seqs=engine.max_num_seqs,
                              max_num_batched_tokens=engine.max_num_batched_tokens)
        injected = deque(sorted(self._fault_requests(), key=lambda extra: extra.at_step))
        stats.requests = len(requests) + len(injected)
        next_id = len(requests)
        with self.phase("serve"):
            start = self.clock.now_ns()
            pending = deque(Sequence(r.request_id, r.prompt_tokens, r.output_tokens, start + r.arrival_ns,
                                     r.stop_tokens)
                            for r in sorted(requests, key=lambda r: (r.arrival_ns, r.request_id)))
            while pending or injected or not scheduler.is_finished():
                while pending and pending[0].arrival_ns <= self.clock.now_ns():
                    self._arrive(scheduler, pending.popleft())
                idle = scheduler.is_finished() and not pending
                while injected and (injected[0].at_step <= stats.steps + 1 or idle):
                    extra = injected.popleft()
                    self._arrive(scheduler, Sequence(next_id, extra.prompt_tokens, extra.output_tokens,
                                                     self.clock.now_ns()))
                    next_id += 1
                if scheduler.is_finished():
                    self.clock.advance_to(pending[0].arrival_ns)
                    continue
                self._step(scheduler, manager)
        return stats

    def _arrive(self, scheduler: Scheduler, seq: Sequence) -> None:
        """Queue a request and record its arrival on rank 0, as the adapters do: the workload a replay reads."""
        scheduler.add(seq)
        self.runners[0].monitor.request_arrived(seq.seq_id, seq.num_prompt_tokens, seq.max_tokens)

    def _fault_requests(self) -> list[ExtraRequest]:
        """Requests the scenario's faults add, each fault counted once however many ranks it applies to."""
        faults = {id(fault): fault for runner in self.runners for fault in runner.faults}
        return [extra for fault in faults.values() for extra in fault.extra_requests()]

    def _step(self, scheduler: Scheduler, manager: BlockManager) -> None:
        stats = self.stats
        seqs, is_prefill = scheduler.schedule()
        lead = self.runners[0]
        if scheduler.preempted_last_step:
            stats.preemptions += scheduler.preempted_last_step
            lead.monitor.preempted(scheduler.preempted_last_step)
        stats.steps += 1
        if is_prefill:
            stats.prefill_steps += 1
            num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        else:
            stats.decode_steps += 1
            num_tokens = len(seqs)
        max_seq_len = max(seq.num_cached_tokens + seq.num_scheduled_tokens for seq in seqs)
        highest_block = max((max(seq.block_table, default=-1) for seq in seqs), default=-1)
        for runner in self.runners:
            runner.before_step(stats.steps)
            runner.check_block_ids(highest_block)
            runner.forward(num_tokens, len(seqs), prefill=is_prefill, max_seq_len=max_seq_len)
        self.clock.advance(self._step_seconds(num_tokens, len(seqs), is_prefill))
        blocks_used = manager.num_used
        load = {"requests_running": len(scheduler.running), "requests_waiting": len(scheduler.waiting),
                "kv_blocks_needed": scheduler.kv_blocks_needed()}  # read where nano-vllm's adapter reads it
        stats.max_kv_blocks_used = max(stats.max_kv_blocks_used, blocks_used)
        stats.max_resident_requests = scheduler.max_resident
        finished = scheduler.postprocess(seqs, is_prefill)
        stats.finished += len(finished)
        for seq in finished:
            lead.monitor.request_finished(seq.seq_id, seq.num_completion_tokens)
        if finished:
            for runner in self.runners:
                runner.requests_finished(stats.steps, len(finished))
        kind = "prefill" if is_prefill else "decode"
        lead.monitor.step(kind, num_seqs=len(seqs), num_tokens=num_tokens, kv_blocks_used=blocks_used,
                          kv_blocks_total=manager.num_blocks, **load)
        for runner in self.runners[1:]:
            runner.monitor.step()

    def _step_seconds(self, num_tokens: int, num_seqs: int, is_prefill: bool) -> float:
        cost = self.cost
        if is_prefill:
            return num_tokens / cost.prefill_tokens_per_s
        return cost.decode_step_s + cost.decode_per_seq_s * num_seqs
