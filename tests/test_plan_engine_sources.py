"""The budget rules and defaults of ``memwatch/plan/engines.py`` against the released engines' own source.

The released vLLM 0.33.0 and nano-vllm wheels that ``make engines`` installs are read as text (nothing
is imported): each function the planner cites must exist there, with the formula and the default
values the planner applies. A new engine release that moves them fails here, not in a user's plan.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from memwatch.plan.engines import GIB, defaults

ENGINES = Path(__file__).resolve().parents[1] / ".engines"


def released(engine: str, path: str) -> str:
    if not (ENGINES / engine / ".installed").exists():
        pytest.fail(f"the released engines are not installed in {ENGINES}: run `make engines`")
    return (ENGINES / engine / path).read_text(encoding="utf-8")


def function(engine: str, path: str, name: str) -> str:
    """The source of function ``name`` in the released file, runs of whitespace made single spaces."""
    text = released(engine, path)
    node = next((node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.FunctionDef) and node.name == name),
                None)
    assert node is not None, f"{path} has no function {name}"
    return " ".join((ast.get_source_segment(text, node) or "").split())


def test_vllm_budget_rule_is_determine_available_memory() -> None:
    worker = function("vllm", "vllm/v1/worker/gpu_worker.py", "determine_available_memory")
    assert ("self.available_kv_cache_memory_bytes = ( self.requested_memory - profile_result.non_kv_cache_memory "
            "- cudagraph_memory_estimate_applied )") in worker
    assert "if kv_cache_memory_bytes := self.cache_config.kv_cache_memory_bytes:" in worker
    requested = function("vllm", "vllm/v1/worker/utils.py", "request_memory")
    assert "math.ceil( init_snapshot.total_memory * cache_config.gpu_memory_utilization )" in requested


def test_vllm_block_size_and_utilization() -> None:
    cache = " ".join(released("vllm", "vllm/config/cache.py").split())
    block = int(re.search(r"DEFAULT_BLOCK_SIZE: ClassVar\[int\] = (\d+)", cache)[1])  # type: ignore[index]
    util = float(re.search(r"gpu_memory_utilization: float = Field\(default=([\d.]+)", cache)[1])  # type: ignore[index]
    rules = defaults("vllm", 24 * GIB)
    assert (rules.block_size, rules.utilization) == (block, util) == (16, 0.92)


def test_vllm_batch_defaults_per_device_tier() -> None:
    batch = function("vllm", "vllm/engine/arg_utils.py", "get_batch_defaults")
    assert "if device_memory >= 160 * GiB_bytes:" in batch and "device_memory >= 70 * GiB_bytes" in batch
    served = [int(value) for value in re.findall(r"UsageContext\.OPENAI_API_SERVER: (\d+)", batch)[:6]]
    tiers = list(zip(served[0::2], served[1::2], strict=True))           # (tokens, seqs) from the largest tier
    assert tiers == [(16_384, 1_024), (8_192, 1_024), (2_048, 256)]
    planned = [defaults("vllm", gib * GIB) for gib in (160, 70, 69)]
    assert [(rules.max_num_batched_tokens, rules.max_num_seqs) for rules in planned] == tiers


def test_vllm_capture_sizes_follow_set_cudagraph_sizes() -> None:
    sizes = function("vllm", "vllm/config/vllm.py", "_set_cudagraph_sizes")
    for step in ("1024 if current_platform.is_device_capability_family(100) else 512",
                 "min( max_num_seqs * decode_query_len * 2, default_max_graph_size )",
                 "min(max_num_tokens, max_cudagraph_capture_size)",
                 "[1, 2, 4] if i <= max_cudagraph_capture_size",
                 "range(8, min(max_cudagraph_capture_size + 1, 256), 8)",
                 "range(256, max_cudagraph_capture_size + 1, 16)",
                 "cudagraph_capture_sizes.append(max_num_tokens)",
                 "uniform_decode_sizes = [max_num_seqs]"):
        assert step in sizes, step


def test_nano_vllm_defaults() -> None:
    tree = ast.parse(released("nanovllm", "nanovllm/config.py"))
    config = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Config")
    fields = {node.target.id: ast.literal_eval(node.value) for node in config.body
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None}
    rules = defaults("nano-vllm", 24 * GIB)
    assert (fields["kvcache_block_size"], fields["gpu_memory_utilization"], fields["max_num_batched_tokens"],
            fields["max_num_seqs"]) == (rules.block_size, rules.utilization, rules.max_num_batched_tokens,
                                        rules.max_num_seqs) == (256, 0.9, 16_384, 512)
