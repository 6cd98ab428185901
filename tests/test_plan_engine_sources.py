"""The budget rules and defaults of ``memwatch/plan/engines.py`` against the released engines' own source.

The released vLLM 0.33.0 and 0.34.0 and nano-vllm wheels that ``make engines`` installs are read as text
(nothing is imported): each function the planner cites must exist there, with the formula and the default
values the planner applies, and where the planner cites a line, on that line. A new engine release that
moves them fails here, not in a user's plan.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from memwatch.models import ModelSpec
from memwatch.plan import PlanInputs, plan_capacity
from memwatch.plan.engines import EXTENSIBLE_MARGIN_FLOOR, EXTENSIBLE_MARGIN_FRACTION, GIB, VLLM_VERSIONS, defaults

ENGINES = Path(__file__).resolve().parents[1] / ".engines"


def released(engine: str, path: str) -> str:
    if not (ENGINES / engine / ".installed").exists():
        pytest.fail(f"the released engines are not installed in {ENGINES}: run `make engines`")
    return (ENGINES / engine / path).read_text(encoding="utf-8")


def line(engine: str, path: str, number: int) -> str:
    """Line ``number`` (from 1) of the released file, stripped."""
    return released(engine, path).splitlines()[number - 1].strip()


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
    rules = defaults("vllm", 24 * GIB, version="0.33")
    assert (rules.block_size, rules.utilization) == (block, util) == (16, 0.92)
    # vllm 0.33.0, vllm/config/cache.py lines 185 and 215.
    assert line("vllm", "vllm/config/cache.py", 185) == "DEFAULT_BLOCK_SIZE: ClassVar[int] = 16"
    assert line("vllm", "vllm/config/cache.py", 215) == (
        "gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)")


def test_vllm_0_34_block_size_and_utilization_as_it_resolves_them() -> None:
    """vllm 0.34.0, vllm/config/cache.py: blocks of 64 tokens (line 185); utilization unset by default (line 216),
    resolved to 1.0 with the extensible KV cache, else to 0.92 (lines 186, 495–501)."""
    path = "vllm/config/cache.py"
    assert line("vllm-0.34", path, 185) == "DEFAULT_BLOCK_SIZE: ClassVar[int] = 64"
    assert line("vllm-0.34", path, 186) == "DEFAULT_GPU_MEMORY_UTILIZATION: ClassVar[float] = 0.92"
    assert line("vllm-0.34", path, 216) == "gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)"
    assert [line("vllm-0.34", path, n) for n in range(495, 502)] == [
        "def resolved_gpu_memory_utilization(self) -> float:",
        '"""`gpu_memory_utilization`, or its default given the sizing mode."""',
        "if self.gpu_memory_utilization is not None:", "return self.gpu_memory_utilization",
        "if self.enable_extensible_kv_cache:", "return 1.0", "return self.DEFAULT_GPU_MEMORY_UTILIZATION"]
    on, off = defaults("vllm", 80 * GIB, version="0.34", extensible=True), defaults("vllm", 80 * GIB, version="0.34")
    assert (on.block_size, on.utilization, off.block_size, off.utilization) == (64, 1.0, 64, 0.92)
    assert defaults("vllm", 80 * GIB, version="0.34.0") == off and VLLM_VERSIONS == ("0.33", "0.34")


def test_vllm_0_34_turns_the_extensible_kv_cache_on_unless_the_kv_size_is_given() -> None:
    """vllm 0.34.0, vllm/config/vllm.py line 3180: ``_resolve_extensible_kv_cache`` enables it where supported
    (CUDA and ROCm) when unset, and an explicit ``kv_cache_memory_bytes`` makes it unsupported."""
    assert line("vllm-0.34", "vllm/config/vllm.py", 3180) == "def _resolve_extensible_kv_cache(self) -> None:"
    resolve = function("vllm-0.34", "vllm/config/vllm.py", "_resolve_extensible_kv_cache")
    assert "elif cache_config.kv_cache_memory_bytes is not None:" in resolve
    assert "enabled = unsupported is None and (exports_fd or not fabric_unavailable)" in resolve
    assert plan_capacity(_qwen(), PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm")).extensible_kv_cache
    assert not plan_capacity(_qwen(), PlanInputs(kv_cache_memory_bytes=GIB, engine="vllm")).extensible_kv_cache


def test_vllm_0_34_extensible_kv_cache_is_sized_on_the_memory_measured_free() -> None:
    """vllm 0.34.0, vllm/v1/worker/extensible_kv_cache.py: the margin's floor and share (lines 64–65, CUDA) and
    ``measure_kv_cache_bytes`` (lines 613–618), which the planner applies with free = total − non-PyTorch −
    weights − graphs and the committed prefix counted in it."""
    path = "vllm/v1/worker/extensible_kv_cache.py"
    assert line("vllm-0.34", path, 64) == "KV_CACHE_MARGIN_FLOOR_BYTES = (3 if current_platform.is_rocm() else 1) << 30"
    assert line("vllm-0.34", path, 65) == "KV_CACHE_MARGIN_FRACTION = 0.75"
    assert (EXTENSIBLE_MARGIN_FLOOR, EXTENSIBLE_MARGIN_FRACTION) == (1 << 30, 0.75)
    assert [line("vllm-0.34", path, n) for n in range(613, 619)] == [
        "non_kv_used = init_free_memory - free_memory - committed_bytes",
        "headroom = free_memory + committed_bytes",
        "margin = max(margin_floor_bytes, int(transient_peak_bytes * margin_fraction))",
        "available = min(requested_memory - non_kv_used, headroom - margin)",
        "available -= max(transient_peak_bytes, torch_reserve_growth_bytes)",
        "return max(available, 0)"]
    # Where 0.34 still sizes by estimate (the cache not extensible), the rule is 0.33's.
    worker = function("vllm-0.34", "vllm/v1/worker/gpu_worker.py", "determine_available_memory")
    assert ("self.available_kv_cache_memory_bytes = ( self.requested_memory - profile_result.non_kv_cache_memory "
            "- cudagraph_memory_estimate )") in worker
    requested = function("vllm-0.34", "vllm/v1/worker/utils.py", "request_memory")
    assert "math.ceil(init_snapshot.total_memory * gpu_memory_utilization)" in requested


def _qwen() -> ModelSpec:
    return ModelSpec.load("Qwen2.5-7B-Instruct")


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
