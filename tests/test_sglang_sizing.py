"""SGLang's KV sizing as the adapter records it, in process: the profiled budget, the pool SGLang sized on it, and
the pool sized again after CUDA-graph capture, into a real ring.

SGLang is ``sglang_inprocess``'s (SGLang 0.5.23 in short, described there); the device is
``test_vllm_gpu_worker``'s stand-in, read through memwatch's own ``CudaProbe``. The scenario, by hand: an 80 GiB GPU
whose CUDA context holds 500 MiB, ``mem_fraction_static`` 0.75, 3 GiB of weights, pages of 16 tokens, a token of
24 layers × 8 KV heads × dim 128 × K and V × 2 bytes = 96 KiB.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sglang_inprocess import RUNNER_MODULE, ModelRunner, install_sglang, model_config, server_args
from test_vllm_gpu_worker import CONTEXT, Device, _ring, _round_up, stand_in_torch

from memwatch_engine.adapters.sglang import runner as sglang_runner
from memwatch_engine.adapters.sglang import sizing
from memwatch_engine.adapters.sglang.state import guard, process
from memwatch_engine.probes.cuda import CudaProbe
from memwatch_engine.ring_format import PHASE_CODES

MiB = 1 << 20
GiB = 1 << 30
CELL = 96 * 1024
PRE_GB = 79.51171875  # free before the weights: 80 GiB − 500 MiB = 79 GiB + 524 MiB
AVAILABLE_GB = 76.51171875  # free at profiling: less the 3 GiB of weights
BUDGET = 56 * GiB + 649 * MiB  # 76 GiB 524 MiB − the slack 79 GiB 524 MiB × 0.25 = 19 GiB 899 MiB
TOKENS = 618_592  # 56 GiB 649 MiB / 96 KiB: 57,993 × 1024 / 96, a whole number of pages of 16


@pytest.fixture
def gpu(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Device]:
    device = Device(80 * GiB)
    torch = stand_in_torch({0: device})
    monkeypatch.setattr(sglang_runner, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    yield device
    sglang_runner.finish()
    sglang_runner.uninstall()
    guard.active = True


def _start(monkeypatch: pytest.MonkeyPatch, gpu: Device, runner: type[ModelRunner] = ModelRunner,
           **published: Any) -> tuple[SimpleNamespace, Any]:
    """SGLang's modules imported and patched, and the target runner started (its weights loaded)."""
    context = install_sglang(monkeypatch, gpu, runner, **published)
    sglang_runner.install_live()
    model_runner = sys.modules[RUNNER_MODULE].ModelRunner(model_config(), 0.75, 0, 29500, server_args())
    return context, model_runner


def _kv_events(runtime_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    sglang_runner.finish()
    _, events, _ = _ring(runtime_dir)
    return dict(events), [data for kind, data in events if kind == "kv_allocated"]


def test_the_default_pool_is_recorded_with_every_input_of_sglangs_rule(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert BUDGET // CELL // 16 * 16 == TOKENS
    _, runner = _start(monkeypatch, gpu)
    runner.alloc_memory_pool()
    runner.init_cuda_graphs()
    assert runner.max_total_num_tokens == TOKENS
    monitor = process.rank.monitor
    sglang_runner.finish()
    header, events, samples = _ring(runtime_dir)
    named = dict(events)
    assert (header.rank, header.world_size, header.meta["engine"], header.meta["model"]) == (0, 1, "sglang",
                                                                                           "Qwen/Qwen3-8B")
    assert named["rank_identity"] == {"role": "worker", "dp_rank": 0, "dp_size": 1, "replica": 0, "tp_rank": 0,
                                      "pp_rank": 0, "attn_dp_rank": 0}
    assert named["sglang_memory_baseline"] == {"pre_model_load_gb": PRE_GB}
    assert named["weights_loaded"]["weights_bytes"] == 3 * GiB
    assert [data["phase"] for kind, data in events if kind == "phase_start"] == ["load", "kv_alloc", "profile",
                                                                                  "cudagraph"]
    assert {PHASE_CODES[phase] for phase in ("load", "kv_alloc", "cudagraph")} <= {s["phase"] for s in samples}
    # Sized on the readings at the end of profiling: the context and the weights' 3 GiB segment, nothing else.
    assert named["kv_allocated"] == {
        "total_bytes": 80 * GiB, "used_bytes": CONTEXT + 3 * GiB, "peak_bytes": 3 * GiB, "current_bytes": 3 * GiB,
        "reserved_bytes": 3 * GiB, "gpu_memory_utilization": 0.75, "block_size": 1, "block_bytes": CELL,
        "num_blocks": TOKENS, "kv_cache_memory_bytes": BUDGET, "budget_rule": "sglang", "kv_unit": "token",
        "kv_cache_bytes": (TOKENS + 16) * CELL, "max_total_num_tokens": TOKENS, "max_running_requests": 48,
        "max_total_tokens": None, "page_size": 16, "available_gb": AVAILABLE_GB, "pre_model_load_gb": PRE_GB,
        "profiled_kv_bytes": BUDGET, "mem_fraction_static": 0.75, "pool_configurator": "DefaultPoolConfigurator",
        "cell_size_bytes": CELL, "fixed_overhead_bytes": 0, "mm_reservation_gb": 0.0}
    assert not monitor.enabled
    config = header.meta["config"]
    assert (config["model_config"], config["data_parallel_size"], config["tensor_parallel_size"]) == (
        "Qwen/Qwen3-8B", 1, 1)


def test_the_run_config_takes_the_names_every_engines_runs_share(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, runner = _start(monkeypatch, gpu)
    runner.alloc_memory_pool()
    assert _kv_events(runtime_dir)[0]["config"] == {
        "gpu_memory_utilization": 0.75, "block_size": 1, "max_num_seqs": 48, "max_model_len": 4096,
        "max_num_batched_tokens": 8192, "enforce_eager": False}


def test_without_chunked_prefill_the_batch_limit_is_the_prefill_limit_and_eager_is_recorded(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_sglang(monkeypatch, gpu, ModelRunner, schedule={"chunked_prefill_size": -1, "max_total_tokens": 300_000})
    sglang_runner.install_live()
    runner = sys.modules[RUNNER_MODULE].ModelRunner(model_config(context_len=2048), 0.75, 0, 29500,
                                                    server_args(disable_cuda_graph=True, max_running_requests=7))
    runner.alloc_memory_pool()
    named = _kv_events(runtime_dir)[0]
    assert named["config"] == {"gpu_memory_utilization": 0.75, "block_size": 1, "max_num_seqs": 7,
                               "max_model_len": 2048, "max_num_batched_tokens": 16384, "enforce_eager": True}
    assert named["kv_allocated"]["max_total_tokens"] == 300_000


def test_a_multimodal_models_reservation_is_an_input_read_while_profiling(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_sglang(monkeypatch, gpu, ModelRunner, mm_reservation_gb=0.5)
    sglang_runner.install_live()
    runner = sys.modules[RUNNER_MODULE].ModelRunner(model_config(is_multimodal=True), 0.75, 0, 29500, server_args())
    gpu.allocate(MiB)  # freed memory after profiling is not what SGLang sized on
    runner.alloc_memory_pool()
    sizing_event = _kv_events(runtime_dir)[0]["kv_allocated"]
    budget = BUDGET - 512 * MiB - 2 * MiB  # less the reservation, and the 2 MiB segment taken before profiling
    assert (sizing_event["mm_reservation_gb"], sizing_event["available_gb"]) == (0.5, AVAILABLE_GB - 2 / 1024)
    assert (sizing_event["profiled_kv_bytes"], sizing_event["num_blocks"]) == (budget, budget // CELL // 16 * 16)


class PostCapture(ModelRunner):
    post_capture = True


def test_the_pool_sized_again_after_capture_is_a_second_sizing_with_what_the_driver_backs(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, runner = _start(monkeypatch, gpu, PostCapture)
    runner.alloc_memory_pool()
    first_page = 2 * MiB  # 16 tokens × 96 KiB = 1.5 MiB, backed as one 2 MiB granule
    assert gpu.mapped == first_page
    runner.init_cuda_graphs()  # 256 MiB of graphs
    runner.post_capture_resize_kv_pool()
    # Free then: 80 GiB − 500 MiB − 3 GiB 256 MiB − 2 MiB = 76 GiB 266 MiB; less the headroom 19 GiB 899 MiB, plus
    # the 2 MiB backed: 56 GiB 393 MiB → 615,861.3 tokens → 615,856, below the first count.
    budget = 56 * GiB + 393 * MiB
    resized = budget // CELL // 16 * 16
    assert runner.max_total_num_tokens == resized == 615_856
    backed = 57_738 * MiB  # 615,856 × 96 KiB = 57,736.5 MiB, backed in whole 2 MiB granules
    assert gpu.mapped == backed
    named, [first, second] = _kv_events(runtime_dir)
    assert (first["num_blocks"], first["kv_outside_allocator_bytes"], first["kv_cache_bytes"]) == (
        TOKENS, first_page, (TOKENS + 16) * CELL)
    assert "sizing_event" not in first
    assert second == {
        "total_bytes": 80 * GiB, "used_bytes": CONTEXT + 3 * GiB + 256 * MiB + first_page,
        "peak_bytes": 3 * GiB + 256 * MiB, "current_bytes": 3 * GiB + 256 * MiB, "reserved_bytes": 3 * GiB + 256 * MiB,
        "gpu_memory_utilization": 0.75, "block_size": 1, "block_bytes": CELL, "num_blocks": resized,
        "kv_cache_memory_bytes": budget, "budget_rule": "sglang", "kv_unit": "token", "kv_cache_bytes": backed,
        "max_total_num_tokens": resized, "max_running_requests": 48, "max_total_tokens": None, "page_size": 16,
        "available_gb": AVAILABLE_GB, "pre_model_load_gb": PRE_GB, "profiled_kv_bytes": BUDGET,
        "mem_fraction_static": 0.75, "pool_configurator": "DefaultPoolConfigurator", "cell_size_bytes": CELL,
        "fixed_overhead_bytes": 0, "mm_reservation_gb": 0.0, "post_capture_available_gb": 76 + 266 / 1024,
        "sizing_event": "post_capture",
        "post_capture_budget_bytes": budget, "post_capture_cap_tokens": TOKENS,
        "kv_outside_in_readings_bytes": first_page, "kv_outside_allocator_bytes": backed}
    assert named["config"] == {"max_num_seqs": 48}  # the running-request limit as the resize left it
    assert named["run_end"]["status"] == "ok"


class Hybrid(ModelRunner):
    """GPT-OSS's layout: 2 full-attention and 6 sliding-window layers, 8 KV heads of dim 128: 4 KiB a layer's token;
    SGLang prices a full token with 0.8 of a sliding one: 8 KiB + 0.8 × 24 KiB = 27,852.8 bytes."""

    hybrid = True
    full_layers, swa_layers = 2, 6
    full_per_token = swa_per_token = 8 * 128 * 2 * 2


def test_a_hybrid_sliding_window_model_is_recorded_pool_by_pool(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, runner = _start(monkeypatch, gpu, Hybrid)
    runner.alloc_memory_pool()
    # 60,810,067,968 / 27,852.8 = 2,183,265.9 → 2,183,264 full tokens; × 0.8 = 1,746,611.2 → 1,746,608 sliding.
    full, swa = 2_183_264, 1_746_608
    assert (runner.full_max_total_num_tokens, runner.swa_max_total_num_tokens) == (full, swa)
    sized = _kv_events(runtime_dir)[0]["kv_allocated"]
    assert sized["kv_pools"] == {"full": {"tokens": full, "cell_size_bytes": 8192},
                                 "swa": {"tokens": swa, "cell_size_bytes": 24576}}
    assert (sized["num_blocks"], sized["block_bytes"], sized["budget_rule"], sized["pool_configurator"]) == (
        full, 8192, "sglang-hybrid-swa", "HybridSWAPoolConfigurator")
    assert (sized["full_cell_size_bytes"], sized["swa_cell_size_bytes"], sized["swa_full_tokens_ratio"],
            sized["swa_plain"]) == (8192, 24576, 0.8, True)
    assert sized["kv_cache_bytes"] == (full + 16) * 8192 + (swa + 16) * 24576
    assert "cell_size_bytes" not in sized and "fixed_overhead_bytes" not in sized


class HybridWithDraft(Hybrid):
    draft_cell = 1000  # a draft model's cell priced into the split: not the split memwatch's rule re-derives


def test_a_hybrid_pool_with_a_drafts_cell_is_recorded_but_claims_no_rule(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, runner = _start(monkeypatch, gpu, HybridWithDraft)
    runner.alloc_memory_pool()
    sized = _kv_events(runtime_dir)[0]["kv_allocated"]
    # 60,810,067,968 / 28,852.8 = 2,107,596.7 → 2,107,584 full tokens, 1,686,064 sliding.
    assert (sized["budget_rule"], sized["swa_plain"], sized["kv_pools"]["full"]["tokens"],
            sized["kv_pools"]["swa"]["tokens"]) == ("sglang-hybrid-swa-draft", False, 2_107_584, 1_686_064)


class RequestCapped(Hybrid):
    request_cap = True


def test_a_request_capped_sliding_window_pool_names_its_configurator(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, runner = _start(monkeypatch, gpu, RequestCapped)
    runner.alloc_memory_pool()
    sized = _kv_events(runtime_dir)[0]["kv_allocated"]
    assert (sized["pool_configurator"], sized["budget_rule"], sized["num_blocks"]) == (
        "SWARequestCapPoolConfigurator", "sglang-hybrid-swa-SWARequestCapPoolConfigurator", 2_183_264)


class AllSlidingWindow(Hybrid):
    full_layers, swa_layers = 0, 6


def test_a_model_of_sliding_window_layers_only_has_one_pool_at_its_cell(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, runner = _start(monkeypatch, gpu, AllSlidingWindow)
    runner.alloc_memory_pool()
    sized = _kv_events(runtime_dir)[0]["kv_allocated"]
    swa = 2_474_368  # 60,810,067,968 / 24,576 = 2,474,368.3 → whole pages
    assert sized["kv_pools"] == {"full": {"tokens": 0, "cell_size_bytes": 0},
                                 "swa": {"tokens": swa, "cell_size_bytes": 24576}}
    assert (sized["num_blocks"], sized["block_bytes"], sized["kv_cache_bytes"]) == (swa, 24576, (swa + 16) * 24576)


def test_a_pool_that_cannot_say_its_bytes_is_sized_without_them() -> None:
    class Failing:
        def get_kv_size_bytes(self) -> int:
            raise NotImplementedError

    assert sizing._pool_bytes(SimpleNamespace()) is None
    assert sizing._pool_bytes(Failing()) is None
    assert sizing._pool_bytes(SimpleNamespace(get_kv_size_bytes=lambda: 3 * MiB)) == 3 * MiB  # one number
    assert sizing._pool_bytes(SimpleNamespace(get_kv_size_bytes=lambda: [MiB, 2 * MiB])) == 3 * MiB


def test_a_pool_configurator_of_another_shape_is_named_only() -> None:
    class DSV4PoolConfigurator:
        """DeepSeek V4's: neither a fixed overhead nor sliding-window cells."""

    assert sizing.pool_inputs(DSV4PoolConfigurator()) == {"pool_configurator": "DSV4PoolConfigurator"}


class HybridPostCapture(Hybrid):
    post_capture = True


def test_each_resize_records_the_free_memory_it_read_itself(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, runner = _start(monkeypatch, gpu, PostCapture)
    runner.alloc_memory_pool()
    runner.init_cuda_graphs()
    runner.post_capture_resize_kv_pool()
    gpu.allocate(2 * GiB)  # then 2 GiB more in use: a second resize reads 2 GiB less free
    runner.post_capture_resize_kv_pool()
    _, [_, first, second] = _kv_events(runtime_dir)
    # Less the 57,736 MiB the first resize backed past its first page, and the 2 GiB: 17 GiB 898 MiB, below the
    # 19 GiB 899 MiB headroom, so the budget is what the pool backs already.
    assert first["post_capture_available_gb"] == 76 + 266 / 1024
    assert second["post_capture_available_gb"] == 17 + 898 / 1024
    assert second["post_capture_budget_bytes"] == 57_738 * MiB


def test_a_hybrid_pool_sized_again_after_capture_records_both_pools_as_resized(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, runner = _start(monkeypatch, gpu, HybridPostCapture)
    runner.alloc_memory_pool()  # each pool backs its first page: 128 KiB and 384 KiB, a 2 MiB granule each
    runner.init_cuda_graphs()
    runner.post_capture_resize_kv_pool()
    # Free: 80 GiB − 500 MiB − 3 GiB 256 MiB − 4 MiB = 76 GiB 264 MiB; less 19 GiB 899 MiB, plus the 4 MiB backed:
    # 56 GiB 393 MiB / 27,852.8 = 2,173,628.2 → 2,173,616 full tokens; × 0.8 = 1,738,892.8 → 1,738,880 sliding.
    full, swa = 2_173_616, 1_738_880
    assert (runner.full_max_total_num_tokens, runner.swa_max_total_num_tokens) == (full, swa)
    _, [first, second] = _kv_events(runtime_dir)
    assert first["kv_pools"]["full"]["tokens"] == 2_183_264 and first["kv_outside_allocator_bytes"] == 4 * MiB
    assert second["kv_pools"] == {"full": {"tokens": full, "cell_size_bytes": 8192},
                                  "swa": {"tokens": swa, "cell_size_bytes": 24576}}
    # 16,981.4 MiB of full tokens and 40,755 MiB of sliding ones, each in whole granules: 16,982 + 40,756 MiB.
    assert (second["num_blocks"], second["kv_outside_allocator_bytes"], second["kv_cache_bytes"]) == (
        full, 57_738 * MiB, 57_738 * MiB)


@pytest.mark.parametrize(("memory", "rule"), [({"unified_memory": True}, "sglang-unified"), ({}, "sglang")])
def test_a_unified_memory_pool_claims_no_rule_and_a_memory_bag_without_the_switch_is_not_one(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, memory: dict[str, bool], rule: str) -> None:
    context, runner = _start(monkeypatch, gpu, **memory)
    if not memory:
        context.memory = SimpleNamespace()  # an SGLang whose memory settings have no unified pool at all
    runner.alloc_memory_pool()
    assert _kv_events(runtime_dir)[0]["kv_allocated"]["budget_rule"] == rule


def test_a_one_token_chunk_is_the_batch_limit_and_server_args_without_the_graph_switch_are_not_eager(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_sglang(monkeypatch, gpu, ModelRunner, schedule={"chunked_prefill_size": 1})
    sglang_runner.install_live()
    args = server_args()
    del args.disable_cuda_graph
    sys.modules[RUNNER_MODULE].ModelRunner(model_config(), 0.75, 0, 29500, args).alloc_memory_pool()
    config = _kv_events(runtime_dir)[0]["config"]
    assert (config["max_num_batched_tokens"], config["enforce_eager"]) == (1, False)


class OtherPool(PostCapture):
    pool_lacks = ("post_capture_backed_bytes",)


class PlainPool(ModelRunner):
    pool_lacks = ("post_capture_active", "post_capture_backed_bytes")


@pytest.mark.parametrize("runner_class", [OtherPool, PlainPool])
def test_a_pool_that_says_nothing_of_its_backing_records_none_outside_the_allocator(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, runner_class: type[ModelRunner]) -> None:
    _, runner = _start(monkeypatch, gpu, runner_class)
    runner.alloc_memory_pool()
    sized = _kv_events(runtime_dir)[0]["kv_allocated"]
    assert "kv_outside_allocator_bytes" not in sized and sized["num_blocks"] == TOKENS


class DeepSeekV4(ModelRunner):
    dsv4 = True


class DeepSeekV4Unmeasured(DeepSeekV4):
    pool_lacks = ("get_kv_size_bytes",)


def test_a_pool_configurator_memwatch_does_not_know_is_sized_on_the_pools_own_bytes(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, runner = _start(monkeypatch, gpu, DeepSeekV4)
    runner.alloc_memory_pool()
    sized = _kv_events(runtime_dir)[0]["kv_allocated"]
    # No pool configurator's inputs: the bytes a token are the pool's, (618,592 + 16) × 96 KiB over 618,592 tokens.
    assert (sized["budget_rule"], sized["num_blocks"], sized["kv_cache_bytes"]) == (
        "sglang-unknown", TOKENS, (TOKENS + 16) * CELL)
    assert sized["block_bytes"] == CELL + 2  # 16 × 96 KiB / 618,592 = 2.5 bytes more a token, rounded down
    assert "pool_configurator" not in sized and "pool_budget_bytes" not in sized


def test_a_pool_that_cannot_measure_itself_has_no_bytes_a_token(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, runner = _start(monkeypatch, gpu, DeepSeekV4Unmeasured)
    runner.alloc_memory_pool()
    sized = _kv_events(runtime_dir)[0]["kv_allocated"]
    assert (sized["num_blocks"], sized["block_bytes"], sized["kv_cache_bytes"]) == (TOKENS, 0, None)


def test_a_device_that_reads_nothing_records_no_sizing_readings(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = stand_in_torch({0: gpu})

    def failing(index: int) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    torch.cuda.mem_get_info = torch._C._cuda_memoryStats = failing
    monkeypatch.setattr(sglang_runner, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    _, runner = _start(monkeypatch, gpu)
    runner.alloc_memory_pool()
    sized = _kv_events(runtime_dir)[0]["kv_allocated"]
    assert [sized[key] for key in ("total_bytes", "used_bytes", "peak_bytes", "current_bytes", "reserved_bytes")] \
        == [None] * 5


def test_a_driver_that_cannot_be_read_leaves_the_allocators_reserve_out_too(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = stand_in_torch({0: gpu})

    def failing(index: int) -> Any:
        raise RuntimeError("CUDA error: unspecified launch failure")

    torch.cuda.mem_get_info = failing
    monkeypatch.setattr(sglang_runner, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    _, runner = _start(monkeypatch, gpu)
    runner.alloc_memory_pool()
    sized = _kv_events(runtime_dir)[0]["kv_allocated"]
    # Without the driver's readings the sizing's are not taken at all: the allocator's reserve is read as the event
    # is written, with the pool in it (3 GiB and 618,608 × 96 KiB, in whole 2 MiB segments), not the sizing's 3 GiB.
    assert (sized["total_bytes"], sized["used_bytes"]) == (None, None)
    assert sized["reserved_bytes"] == _round_up(3 * GiB + (TOKENS + 16) * CELL, 2 * MiB) == 64_034_439_168
