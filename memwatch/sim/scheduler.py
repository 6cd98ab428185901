"""nano-vllm's scheduler: all-prefill or all-decode steps, chunked prefill, preemption by recompute.

The rules follow ``nanovllm/engine/scheduler.py`` (chunked-prefill version):

* **Prefill first.** Take sequences from the head of ``waiting`` while fewer than ``max_num_seqs`` are
  scheduled and the ``max_num_batched_tokens`` budget lasts. A sequence without blocks is admitted only
  if the block manager can hold its whole prompt; otherwise admission stops. Only the first sequence of
  a step may be cut short (chunked); a sequence joins ``running`` once its whole prompt is scheduled.
* **Decode** only when no prefill was scheduled: take sequences from the head of ``running``; when one
  needs a new block and none is free, preempt the **most recently added** running sequence (the tail),
  or the sequence itself when it is the last one. Preemption drops all of a sequence's KV and puts it
  back at the head of ``waiting`` to be prefilled again.

What nano-vllm does not keep and the simulator adds: counts of preemptions, and the largest number of
requests holding KV blocks at once.
"""

from __future__ import annotations

from collections import deque

from memwatch.errors import MemwatchError
from memwatch.sim.blocks import BlockManager
from memwatch.sim.sequence import Sequence, SequenceStatus
from memwatch_engine.load import kv_blocks_needed


class SchedulerStalled(MemwatchError):
    """Nothing can be scheduled and nothing is running: a request can never fit in the KV cache."""


class Scheduler:
    """Batches the sequences of one engine; only rank 0 of a tensor-parallel group schedules."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.preempted_last_step = 0
        self.max_resident = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    @property
    def num_resident(self) -> int:
        """Requests holding KV blocks: every running one plus a waiting one mid-way through its prefill."""
        return len(self.running) + sum(1 for seq in self.waiting if seq.block_table)

    def kv_blocks_needed(self) -> int:
        """KV blocks the running sequences still need to reach their ``max_tokens`` (the step's load)."""
        return kv_blocks_needed(((seq.num_tokens, seq.num_prompt_tokens + seq.max_tokens) for seq in self.running),
                                self.block_size)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next step's sequences and whether it is a prefill step."""
        self.preempted_last_step = 0
        scheduled = self._schedule_prefill()
        if scheduled:
            self.max_resident = max(self.max_resident, self.num_resident)
            return scheduled, True
        scheduled = self._schedule_decode()
        if not scheduled:
            raise SchedulerStalled(self._stall_reason())
        self.max_resident = max(self.max_resident, self.num_resident)
        return scheduled, False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        batched = 0
        manager = self.block_manager
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = self.max_num_batched_tokens - batched
            if remaining == 0:
                break
            if not seq.block_table:
                num_cached_blocks = manager.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                num_tokens = seq.num_tokens - num_cached_blocks * self.block_size
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            if remaining < num_tokens and scheduled:  # only the first sequence may be chunked
                break
            if not seq.block_table:
                manager.allocate(seq, num_cached_blocks)
            seq.num_scheduled_tokens = min(num_tokens, remaining)
            batched += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        manager = self.block_manager
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                seq.is_prefill = False
                manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV and queue it first, to be prefilled again."""
        seq.status = SequenceStatus.WAITING
        seq.is_prefill = True
        seq.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preempted_last_step += 1

    def postprocess(self, seqs: list[Sequence], is_prefill: bool) -> list[Sequence]:
        """Account the step's tokens; every sequence that completed its prompt samples one token.

        Returns the sequences that finished: ``max_tokens`` outputs, or their end of sequence (``stop_tokens``).
        """
        finished = []
        for seq in seqs:
            self.block_manager.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if is_prefill and seq.num_cached_tokens < seq.num_tokens:
                continue
            seq.append_token()
            if seq.num_completion_tokens == seq.stop_tokens:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _stall_reason(self) -> str:
        total = self.block_manager.num_blocks
        if self.waiting:
            seq = self.waiting[0]
            return (f"request {seq.seq_id} needs {seq.num_blocks(self.block_size)} KV blocks of "
                    f"{self.block_size} tokens but the cache has only {total}; shorten the request, lower "
                    "max_model_len or give the KV cache more memory")
        return f"nothing left to schedule with {total} KV blocks; give the KV cache more memory"
