"""nano-vllm's block manager: fixed-size KV blocks, a free queue, and prefix reuse of freed blocks.

The rules follow ``nanovllm/engine/block_manager.py``: blocks are handed out from the head of a free
queue and returned to its tail; a block freed with content keeps it until it is handed out again, so a
preempted sequence that comes back can reuse its own full blocks (a prefix-cache hit) as long as no one
took them meanwhile. A simulated request carries no token ids, so the content of block ``i`` of a
sequence is identified by ``(seq_id, i)`` where nano-vllm chains xxhash digests; requests never share
content, so hits only come from a sequence's own earlier blocks.
"""

from __future__ import annotations

from collections import deque

from memwatch.sim.sequence import Sequence

ContentKey = tuple[int, int]


class Block:
    __slots__ = ("block_id", "key", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: ContentKey | None = None


class BlockManager:
    """``num_blocks`` KV blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block manager needs at least one block of at least one token, "
                             f"got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.key_to_block_id: dict[ContentKey, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used(self) -> int:
        return len(self.used_block_ids)

    def _cached_block(self, key: ContentKey) -> int:
        block_id = self.key_to_block_id.get(key, -1)
        return block_id if block_id != -1 and self.blocks[block_id].key == key else -1

    def _allocate_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.key is not None and self.key_to_block_id.get(block.key) == block_id:
            del self.key_to_block_id[block.key]
        block.key = None
        block.ref_count = 1
        self.used_block_ids.add(block_id)
        return block_id

    def can_allocate(self, seq: Sequence) -> int:
        """-1 when the free blocks cannot hold the sequence, else how many leading blocks are cached.

        The last block is never looked up (it may be partial), as in nano-vllm.
        """
        num_cached = 0
        num_new = seq.num_blocks(self.block_size)
        for i in range(num_new - 1):
            block_id = self._cached_block((seq.seq_id, i))
            if block_id == -1:
                break
            num_cached += 1
            if block_id in self.used_block_ids:
                num_new -= 1
        return -1 if len(self.free_block_ids) < num_new else num_cached

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        for i in range(num_cached_blocks):
            block_id = self.key_to_block_id[(seq.seq_id, i)]
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                block.ref_count = 1
                self.free_block_ids.remove(block_id)
                self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)
        for _ in range(num_cached_blocks, seq.num_blocks(self.block_size)):
            seq.block_table.append(self._allocate_block())
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def deallocate(self, seq: Sequence) -> None:
        """Return the sequence's blocks, last first, keeping their content for later hits."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def _starts_block(self, seq: Sequence) -> bool:
        """The sequence's newest token is the first of a block (every token is, with blocks of one token)."""
        return (len(seq) - 1) % self.block_size == 0

    def can_append(self, seq: Sequence) -> bool:
        """A decode step needs a new block only when its token starts one."""
        return len(self.free_block_ids) >= self._starts_block(seq)

    def may_append(self, seq: Sequence) -> None:
        if self._starts_block(seq):
            seq.block_table.append(self._allocate_block())

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks this step's scheduled tokens completed as reusable content."""
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            block.key = (seq.seq_id, i)
            self.key_to_block_id[block.key] = block.block_id
