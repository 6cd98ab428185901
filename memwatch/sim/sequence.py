"""One request's life inside the simulated engine: its tokens, its KV blocks, its status.

Mirrors nano-vllm's ``Sequence`` field for field where the scheduler and block manager look, without
token ids: a simulated request's content is identified by ``(seq_id, block index)`` instead.
"""

from __future__ import annotations

from enum import Enum


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request being served: ``num_tokens`` grows by one per decode step until ``max_tokens`` outputs, or
    ``stop_tokens`` of them when its end of sequence comes first (unknown to the scheduler until it comes)."""

    __slots__ = (
        "arrival_ns", "block_table", "is_prefill", "max_tokens",
        "num_cached_tokens", "num_preemptions", "num_prompt_tokens", "num_scheduled_tokens",
        "num_tokens", "seq_id", "status", "stop_tokens",
    )

    def __init__(self, seq_id: int, num_prompt_tokens: int, max_tokens: int, arrival_ns: int = 0,
                 stop_tokens: int | None = None) -> None:
        if num_prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(f"a request needs at least one prompt and one output token, "
                             f"got {num_prompt_tokens} and {max_tokens}")
        if stop_tokens is not None and not 1 <= stop_tokens <= max_tokens:
            raise ValueError(f"a request stops after 1 to max_tokens ({max_tokens}) outputs, not {stop_tokens}")
        self.stop_tokens = max_tokens if stop_tokens is None else stop_tokens
        self.seq_id = seq_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.arrival_ns = arrival_ns
        self.num_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.status = SequenceStatus.WAITING
        self.is_prefill = True
        self.block_table: list[int] = []
        self.num_preemptions = 0

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, tokens={self.num_tokens}, cached={self.num_cached_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold every token so far."""
        return -(-self.num_tokens // block_size)

    def append_token(self) -> None:
        self.num_tokens += 1
