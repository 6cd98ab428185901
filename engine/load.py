"""The engine's load after a step, as its sample carries it: what the sidecar's headroom gauges need.

``kv_blocks_needed`` is what a KV-usage fraction cannot show: the blocks the running requests will
still claim before they finish. A request that has ``now`` tokens in the cache and ends at ``end``
tokens (its prompt plus its ``max_tokens``) needs ``ceil(end / B) − ceil(now / B)`` more blocks of ``B``
tokens. Adapters sum it over the scheduler's running requests once per step, on the rank that reports
the KV blocks: a few hundred nanoseconds per running request, against a step of milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable


def kv_blocks_needed(requests: Iterable[tuple[int, int]], block_size: int) -> int:
    """Blocks of ``block_size`` tokens that requests given as (tokens now, tokens at the end) still need."""
    b = block_size
    return sum(max(now_blocks, end_blocks) - now_blocks
               for now_blocks, end_blocks in ((-(-now // b), -(-end // b)) for now, end in requests))
