"""A tiny fleet scenario the fleet's tests build on: one small GPU, one short request."""

from __future__ import annotations

TINY = """
name = "tiny"
model = "Qwen3-0.6B"
[gpu]
total_bytes = 8_589_934_592
[engine]
max_num_batched_tokens = 4096
max_model_len = 8192
[[workload.requests]]
prompt_tokens = 100
output_tokens = 10
"""
"""8 GiB, batches of 4,096 tokens, one request of 100 + 10 tokens (append ``count``/``interval_s`` for more)."""
