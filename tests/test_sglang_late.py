"""memwatch injected into an SGLang scheduler process that is already serving, in process: what ``late.attach`` reads
from the live model runner, into a real ring, and what ``detach`` puts back. SGLang is ``sglang_inprocess``'s, started
without memwatch; the scenario's numbers are ``test_sglang_sizing``'s.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_inprocess import RUNNER_MODULE, install_sglang, model_config, server_args
from test_sglang_sizing import CELL, TOKENS, DeepSeekV4, Hybrid, ModelRunner
from test_vllm_gpu_worker import Device, _ring, stand_in_torch

from memwatch_engine.adapters.sglang import late as sglang_late
from memwatch_engine.adapters.sglang import runner as sglang_runner
from memwatch_engine.adapters.sglang.state import guard, process
from memwatch_engine.probes.cuda import CudaProbe

GiB = 1 << 30
RUN = "late-sglang-1"
UNKNOWN_TERMS = ["activation_reserve_bytes", "torch_other_bytes", "headroom_bytes", "residual_bytes"]


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Device]:
    device = Device(80 * GiB)
    torch = stand_in_torch({0: device})
    monkeypatch.setattr(sglang_late, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(tmp_path / "elsewhere"))
    yield device
    sglang_runner.finish()
    sglang_late.detach()
    guard.active = True


def _serving(monkeypatch: pytest.MonkeyPatch, gpu: Device, runner: type[ModelRunner] = ModelRunner,
             **published: Any) -> Any:
    """SGLang's modules imported and its target runner sized, all without memwatch."""
    install_sglang(monkeypatch, gpu, runner, **published)
    target = sys.modules[RUNNER_MODULE].ModelRunner(model_config(), 0.75, 0, 29500, server_args())
    target.alloc_memory_pool()
    return target


def _attach(runtime_dir: Path) -> list[Any] | None:
    return sglang_late.attach(run_id=RUN, runtime_dir=str(runtime_dir))


def test_a_process_with_no_sized_target_runner_is_not_attached(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _attach(runtime_dir) is None  # no SGLang at all
    install_sglang(monkeypatch, gpu, ModelRunner)
    runner_class = sys.modules[RUNNER_MODULE].ModelRunner
    loading = runner_class(model_config(), 0.75, 0, 29500, server_args())  # its pool not sized yet
    draft = runner_class(model_config(), 0.75, 0, 29500, server_args(), is_draft_worker=True)
    draft.alloc_memory_pool()
    originals = dict(vars(runner_class))
    assert _attach(runtime_dir) is None and loading.pre_model_load_memory > 0
    assert dict(vars(runner_class)) == originals and list(runtime_dir.glob("*.ring")) == []


def test_a_serving_runner_records_its_pool_weights_and_identity(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _serving(monkeypatch, gpu, parallel={"tp_size": 2, "tp_rank": 1, "attn_tp_rank": 1})
    originals = dict(vars(sys.modules[RUNNER_MODULE].ModelRunner))
    [monitor] = _attach(runtime_dir)
    assert process.rank.monitor is monitor and process.rank.records_requests is False
    assert _attach(runtime_dir) == [monitor]  # attached once
    assert dict(vars(sys.modules[RUNNER_MODULE].ModelRunner)) != originals
    sglang_late.detach()
    assert process.rank is None and dict(vars(sys.modules[RUNNER_MODULE].ModelRunner)) == originals
    monitor.close("ok")
    header, events, _ = _ring(runtime_dir, 1)
    assert (header.rank, header.world_size, header.run_id) == (1, 2, RUN)
    assert (header.meta["engine"], header.meta["model"], header.meta["source"]) == ("sglang", "Qwen/Qwen3-8B",
                                                                                    "injected")
    assert {"attached_late": True, "data_parallel_size": 1, "tensor_parallel_size": 1}.items() <= \
        header.meta["config"].items()
    named = dict(events)
    assert named["rank_identity"]["tp_rank"] == 1
    assert named["attached_late"] == {"unknown_terms": UNKNOWN_TERMS, "reason": (
        "memwatch was injected after SGLang started: the readings it sized its token pool on were never taken")}
    assert named["weights_loaded"]["weights_bytes"] == 3 * GiB  # the tied embedding counted once
    assert (header.meta["config"]["dtype"], process.rank is None) == ("bfloat16", True)
    assert named["kv_allocated"] == {
        "total_bytes": 80 * GiB, "gpu_memory_utilization": 0.75, "used_bytes": None, "peak_bytes": None,
        "current_bytes": None, "reserved_bytes": None, "num_blocks": TOKENS, "block_bytes": CELL, "block_size": 1,
        "kv_unit": "token", "max_total_num_tokens": TOKENS, "page_size": 16, "budget_rule": "sglang",
        "attached_late": True}
    assert target.max_total_num_tokens == TOKENS


def test_a_hybrid_pool_is_read_pool_by_pool(gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _serving(monkeypatch, gpu, Hybrid)
    [monitor] = _attach(runtime_dir)
    assert process.rank.records_requests is True
    monitor.close("ok")
    sized = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert sized["kv_pools"] == {"full": {"tokens": 2_183_264, "cell_size_bytes": 8192},
                                 "swa": {"tokens": 1_746_608, "cell_size_bytes": 24576}}
    assert (sized["block_bytes"], sized["budget_rule"]) == (8192, "sglang-hybrid-swa")


class AllSliding(Hybrid):
    full_layers = 0


def test_a_pool_of_sliding_window_layers_only_is_read_at_its_cell(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _serving(monkeypatch, gpu, AllSliding)
    del target.full_max_total_num_tokens  # a runner that keeps no full pool's count
    [monitor] = _attach(runtime_dir)
    monitor.close("ok")
    sized = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert sized["kv_pools"] == {"full": {"tokens": 0, "cell_size_bytes": 0},
                                 "swa": {"tokens": 2_474_368, "cell_size_bytes": 24576}}
    assert sized["block_bytes"] == 24576


def test_a_pool_configurator_that_cannot_say_its_cell_and_a_unified_pool_name_their_rule(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _serving(monkeypatch, gpu, DeepSeekV4, unified_memory=True)
    del target.model  # and a runner that holds no model
    [monitor] = _attach(runtime_dir)
    monitor.close("ok")
    named = dict(_ring(runtime_dir)[1])
    assert (named["kv_allocated"]["block_bytes"], named["kv_allocated"]["budget_rule"]) == (None, "sglang-unified")
    assert named["attached_late"]["unknown_terms"] == ["weights_bytes", *UNKNOWN_TERMS]
    assert "weights_loaded" not in named


def test_a_runner_without_its_configurator_is_read_without_a_rule_and_a_blind_device_without_a_total(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = stand_in_torch({0: gpu})

    def failing(index: int) -> Any:
        raise RuntimeError("CUDA error: unspecified launch failure")

    torch.cuda.mem_get_info = failing
    monkeypatch.setattr(sglang_late, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    target = _serving(monkeypatch, gpu)
    del target.kv_cache_configurator
    [monitor] = _attach(runtime_dir)
    monitor.close("ok")
    sized = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert (sized["total_bytes"], sized["block_bytes"], sized["budget_rule"]) == (None, None, "sglang-unknown")


def test_a_pool_configurator_module_of_another_shape_leaves_the_cell_unknown(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _serving(monkeypatch, gpu)
    pools = sys.modules["sglang.srt.model_executor.pool_configurator"]

    class HybridSWAPoolConfigurator:
        """A sliding-window configurator without the draft model's fields the adapter reads (another version)."""

        def _swa_cell_bytes(self) -> int:
            return 24576

    monkeypatch.setattr(pools, "create_memory_pool_configurator", lambda kvc: HybridSWAPoolConfigurator())
    [monitor] = _attach(runtime_dir)
    monitor.close("ok")
    sized = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert (sized["block_bytes"], sized["budget_rule"]) == (None, "sglang-unknown")


def test_a_pipeline_stage_claims_no_rule_and_a_model_on_the_cpu_has_no_gpu_weights(
        gpu: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _serving(monkeypatch, gpu, parallel={"pp_size": 2, "pp_rank": 1, "tp_size": 1})
    for tensor in target.model.parameters():
        tensor.is_cuda = False  # offloaded to the host: nothing of it on the GPU
    [monitor] = _attach(runtime_dir)
    assert process.rank.records_requests is False and process.rank.identity.pp_rank == 1
    monitor.close("ok")
    named = dict(_ring(runtime_dir, 1)[1])
    assert named["kv_allocated"]["budget_rule"] == "sglang-pipeline"
    assert "weights_loaded" not in named and named["attached_late"]["unknown_terms"][0] == "weights_bytes"
