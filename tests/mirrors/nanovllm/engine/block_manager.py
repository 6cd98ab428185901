"""Mirror of ``nanovllm/engine/block_manager.py``: block accounting with prefix caching.

Full blocks are known by a chained hash of their tokens (upstream: ``xxhash``; here Python's hash of
the previous hash and the token tuple, stable within a process). ``can_allocate`` walks the prompt's
full blocks but the last and counts the leading ones already cached (in use or freed but not yet
reused); a freed block keeps its hash until it is handed out again. ``hash_blocks`` registers the
blocks a step completed (called from ``Scheduler.postprocess``).
"""

from collections import deque

from nanovllm.engine.sequence import Sequence


def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
    return hash((prefix, tuple(token_ids)))


class Block:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids = []

    def update(self, hash: int, token_ids: list[int]):
        self.hash = hash
        self.token_ids = token_ids

    def reset(self):
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def _allocate_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _deallocate_block(self, block_id: int):
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def _cached_prefix(self, seq: Sequence) -> tuple[int, int]:
        """(leading full blocks already cached, how many of them are free now), never the last block."""
        cached = revived = 0
        prefix = -1
        for i in range(seq.num_blocks - 1):
            token_ids = seq.block(i)
            prefix = compute_hash(token_ids, prefix)
            block_id = self.hash_to_block_id.get(prefix, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            cached += 1
            revived += block_id not in self.used_block_ids
        return cached, revived

    def can_allocate(self, seq: Sequence) -> int:
        cached, revived = self._cached_prefix(seq)
        needed = seq.num_blocks - cached + revived
        return -1 if len(self.free_block_ids) < needed else cached

    def allocate(self, seq: Sequence, num_cached_blocks: int):
        prefix = -1
        for i in range(num_cached_blocks):
            prefix = compute_hash(seq.block(i), prefix)
            block_id = self.hash_to_block_id[prefix]
            if block_id in self.used_block_ids:
                self.blocks[block_id].ref_count += 1
            else:
                self.free_block_ids.remove(block_id)
                self.blocks[block_id].ref_count = 1
                self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)
        for _ in range(num_cached_blocks, seq.num_blocks):
            seq.block_table.append(self._allocate_block())
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def deallocate(self, seq: Sequence):
        for block_id in reversed(seq.block_table):
            self.blocks[block_id].ref_count -= 1
            if self.blocks[block_id].ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence):
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._allocate_block())

    def hash_blocks(self, seq: Sequence):
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        prefix = self.blocks[seq.block_table[start - 1]].hash if start > 0 else -1
        for i in range(start, end):
            token_ids = seq.block(i)
            prefix = compute_hash(token_ids, prefix)
            self.blocks[seq.block_table[i]].update(prefix, token_ids)
            self.hash_to_block_id[prefix] = seq.block_table[i]
