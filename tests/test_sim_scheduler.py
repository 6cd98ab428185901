"""The block manager and scheduler against hand-worked cases of nano-vllm's rules."""

from __future__ import annotations

import pytest

from memwatch.sim.blocks import BlockManager
from memwatch.sim.scheduler import Scheduler, SchedulerStalled
from memwatch.sim.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 10, block_size: int = 16, *, max_num_seqs: int = 4,
         max_num_batched_tokens: int = 64) -> tuple[BlockManager, Scheduler]:
    manager = BlockManager(num_blocks, block_size)
    return manager, Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def run_step(scheduler: Scheduler) -> tuple[bool, list[tuple[int, int]], list[int]]:
    """One engine step: (is_prefill, [(seq_id, scheduled tokens)], ids of sequences that finished)."""
    seqs, is_prefill = scheduler.schedule()
    batch = [(seq.seq_id, seq.num_scheduled_tokens) for seq in seqs]
    finished = scheduler.postprocess(seqs, is_prefill)
    return is_prefill, batch, [seq.seq_id for seq in finished]


def test_three_requests_on_ten_blocks_of_sixteen_tokens() -> None:
    manager, scheduler = make()
    a, b, c = Sequence(0, 40, 20), Sequence(1, 40, 20), Sequence(2, 50, 20)
    for seq in (a, b, c):
        scheduler.add(seq)

    # Prefill, one request per step: 40 + 40 > 64 tokens and only the first of a step may be chunked.
    assert run_step(scheduler) == (True, [(0, 40)], [])            # A: ceil(40/16) = 3 blocks -> 0, 1, 2
    assert run_step(scheduler) == (True, [(1, 40)], [])            # B: 3 blocks -> 3, 4, 5
    assert run_step(scheduler) == (True, [(2, 50)], [])            # C: ceil(50/16) = 4 blocks -> 6..9
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4, 5], [6, 7, 8, 9])
    assert manager.num_free == 0 and scheduler.max_resident == 3

    # Decode: after prefill each has sampled one token (A, B: 41, C: 51). A decode step needs a new
    # block when len % 16 == 1: A and B at len 49, i.e. the 9th decode step (step 12); C only at 65.
    for _ in range(4, 12):
        assert run_step(scheduler) == (False, [(0, 1), (1, 1), (2, 1)], [])
    assert run_step(scheduler) == (False, [(0, 1), (1, 1)], [])    # step 12
    # No block free for A: the most recently added running sequence, C, is preempted (all its KV
    # dropped); its blocks return last-first (9, 8, 7, 6), so A gets 9 and B gets 8.
    assert scheduler.preempted_last_step == 1 and scheduler.num_preemptions == 1
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and len(c) == 59
    assert (a.block_table, b.block_table) == ([0, 1, 2, 9], [3, 4, 5, 8])
    assert list(manager.free_block_ids) == [7, 6]
    assert list(scheduler.waiting) == [c]

    # C needs ceil(59/16) = 4 blocks; its first two full blocks (6, 7) are still cached, but 2 free < 4.
    assert manager.can_allocate(c) == -1
    for _ in range(13, 22):
        assert run_step(scheduler) == (False, [(0, 1), (1, 1)], [])
    # A and B reach 20 outputs after 1 (prefill) + 19 decode steps (4..22).
    assert run_step(scheduler) == (False, [(0, 1), (1, 1)], [0, 1])

    # Step 23: C comes back; blocks 6 and 7 hit (32 tokens), so only 59 - 32 = 27 tokens are recomputed.
    assert run_step(scheduler) == (True, [(2, 27)], [])
    assert c.block_table[:2] == [6, 7] and c.num_cached_tokens == 59
    # C had 9 outputs when preempted, the re-prefill samples the 10th, 10 decode steps finish it.
    for _ in range(24, 33):
        assert run_step(scheduler) == (False, [(2, 1)], [])
    assert run_step(scheduler) == (False, [(2, 1)], [2])
    assert scheduler.is_finished() and manager.num_free == 10
    assert (scheduler.num_preemptions, scheduler.max_resident, c.num_preemptions) == (1, 3, 1)


def test_chunked_prefill_cuts_only_the_first_sequence_of_a_step() -> None:
    _, scheduler = make(max_num_batched_tokens=64)
    long, short = Sequence(0, 100, 5), Sequence(1, 20, 5)
    scheduler.add(long)
    scheduler.add(short)
    assert run_step(scheduler) == (True, [(0, 64)], [])      # chunk: 64 of 100; blocks for all 100 held
    assert len(long.block_table) == 7 and long.status is SequenceStatus.WAITING
    assert scheduler.num_resident == 1
    assert run_step(scheduler) == (True, [(0, 36), (1, 20)], [])   # the rest (36), then 20 more fit in 28
    assert [seq.seq_id for seq in scheduler.running] == [0, 1]
    assert run_step(scheduler) == (False, [(0, 1), (1, 1)], [])


def test_prefill_admits_at_most_max_num_seqs() -> None:
    _, scheduler = make(max_num_seqs=2, max_num_batched_tokens=1000)
    for i in range(3):
        scheduler.add(Sequence(i, 10, 2))
    assert run_step(scheduler) == (True, [(0, 10), (1, 10)], [])
    assert run_step(scheduler) == (True, [(2, 10)], [])
    assert run_step(scheduler) == (False, [(0, 1), (1, 1)], [0, 1])


def test_a_lone_sequence_preempts_itself_and_a_request_that_cannot_fit_stalls() -> None:
    _, scheduler = make(num_blocks=2, block_size=16)
    seq = Sequence(0, 32, 5)                     # exactly 2 blocks; its first decode token needs a 3rd
    scheduler.add(seq)
    assert run_step(scheduler) == (True, [(0, 32)], [])
    with pytest.raises(SchedulerStalled, match="request 0 needs 3 KV blocks of 16 tokens but the cache has only 2"):
        scheduler.schedule()
    assert scheduler.num_preemptions == 1 and seq.status is SequenceStatus.WAITING


def test_decode_takes_a_block_only_when_its_token_starts_one() -> None:
    manager = BlockManager(3, 16)
    seq = Sequence(0, 16, 4)
    manager.allocate(seq, manager.can_allocate(seq))
    assert seq.block_table == [0]
    seq.append_token()                            # len 17: 17 % 16 == 1 -> the token starts block 2
    assert manager.can_append(seq)
    manager.may_append(seq)
    seq.append_token()                            # len 18: still in block 2
    manager.may_append(seq)
    assert seq.block_table == [0, 1] and manager.num_used == 2


def test_with_blocks_of_one_token_every_decoded_token_takes_a_block() -> None:
    """SGLang's token pool (and vLLM's block size 1): each token is a block of its own."""
    manager = BlockManager(8, 1)
    seq = Sequence(0, 5, 3)
    manager.allocate(seq, manager.can_allocate(seq))
    assert seq.block_table == [0, 1, 2, 3, 4]
    for _ in range(3):
        seq.append_token()
        assert manager.can_append(seq)
        manager.may_append(seq)
    assert seq.block_table == list(range(8)) and manager.num_free == 0
    seq.append_token()
    assert not manager.can_append(seq)


def test_freed_blocks_keep_their_content_until_reused() -> None:
    manager = BlockManager(6, 16)
    seq = Sequence(7, 40, 1)                      # 3 blocks (0, 1, 2), two of them full
    manager.allocate(seq, manager.can_allocate(seq))
    seq.num_scheduled_tokens = 40
    manager.hash_blocks(seq)                      # registers blocks 0 and 1 (40 // 16 = 2 full)
    seq.num_scheduled_tokens = 0
    manager.deallocate(seq)
    assert list(manager.free_block_ids) == [3, 4, 5, 2, 1, 0]
    assert manager.can_allocate(seq) == 2         # blocks 0 and 1 hit; the last block is never looked up
    fillers = [Sequence(100 + i, 16, 1) for i in range(5)]
    for filler in fillers:                        # take 3, 4, 5, 2, then 1: block 1's content is dropped
        manager.allocate(filler, manager.can_allocate(filler))
    assert [filler.block_table[0] for filler in fillers] == [3, 4, 5, 2, 1]
    for filler in fillers:
        manager.deallocate(filler)
    assert manager.can_allocate(seq) == 1         # only block 0 still holds seq's content
    manager.allocate(seq, 1)
    assert seq.block_table[0] == 0 and seq.num_cached_tokens == 16
