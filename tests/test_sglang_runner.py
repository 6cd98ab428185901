"""SGLang's model runner wrapped in process: which runner is a rank, where its ring reads, its phases, and what
``uninstall`` puts back. SGLang is ``sglang_inprocess``'s; the scenario's numbers are ``test_sglang_sizing``'s.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from sglang_inprocess import (
    CONFIGURATOR_MODULE,
    POOL_MODULE,
    RESIZE_MODULE,
    RUNNER_MODULE,
    DefaultPoolConfigurator,
    KVCacheConfigurator,
    ModelRunner,
    install_sglang,
    model_config,
    server_args,
)
from test_sglang_sizing import PRE_GB, TOKENS, PostCapture
from test_vllm_gpu_worker import Device, _ring, stand_in_torch

from memwatch_engine.adapters import hooks
from memwatch_engine.adapters.sglang import runner as sglang_runner
from memwatch_engine.adapters.sglang import sizing
from memwatch_engine.adapters.sglang.state import guard, process
from memwatch_engine.probes.cuda import CudaProbe

GiB = 1 << 30


@pytest.fixture
def gpus(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, Device]]:
    """An 80 GiB GPU and a 48 GiB one."""
    devices = {0: Device(80 * GiB), 1: Device(48 * GiB)}
    torch = stand_in_torch(devices)
    monkeypatch.setattr(sglang_runner, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    yield devices
    sglang_runner.finish()
    sglang_runner.uninstall()
    guard.active = True


def _install(monkeypatch: pytest.MonkeyPatch, gpu: Device, runner: type[ModelRunner] = ModelRunner,
             **published: Any) -> Any:
    install_sglang(monkeypatch, gpu, runner, **published)
    sglang_runner.install_live()
    return sys.modules[RUNNER_MODULE].ModelRunner


def _events(runtime_dir: Path, rank: int = 0) -> list[tuple[str, dict[str, Any]]]:
    sglang_runner.finish()
    return _ring(runtime_dir, rank)[1]


def test_the_target_runner_is_the_rank_and_a_draft_runner_is_not(
        gpus: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner_class = _install(monkeypatch, gpus[0])
    draft_first = runner_class(model_config(), 0.75, 0, 29500, server_args(), is_draft_worker=True)
    assert process.rank is None  # a draft model's runner starts no rank
    target = runner_class(model_config(), 0.75, 0, 29500, server_args())
    state = process.rank
    draft = runner_class(model_config(), 0.75, 0, 29500, server_args(), is_draft_worker=True)
    again = runner_class(model_config(), 0.75, 0, 29500, server_args())  # one rank a process
    assert process.rank is state
    for runner in (target, draft, draft_first, again):
        runner.alloc_memory_pool()
    draft.init_cuda_graphs()
    events = _events(runtime_dir)
    kinds = [kind for kind, _ in events]
    # The second target runner's own baseline, load and sizing are recorded; the drafts' never.
    assert kinds.count("sglang_memory_baseline") == 2 and kinds.count("weights_loaded") == 2
    assert [data["phase"] for kind, data in events if kind == "phase_start"] == [
        "load", "load", "kv_alloc", "profile", "kv_alloc", "profile"]
    assert kinds.count("kv_allocated") == 2 and kinds[-1] == "run_end"


def test_a_runner_built_by_keywords_reads_the_gpu_it_was_given(
        gpus: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner_class = _install(monkeypatch, gpus[1], parallel={"tp_size": 2, "tp_rank": 1, "attn_tp_rank": 1})
    runner_class(model_config=model_config(), mem_fraction_static=0.75, gpu_id=1, nccl_port=29500,
                 server_args=server_args(model_path="meta-llama/Llama-3.1-8B", tp_size=2))
    assert process.rank.records_requests is False  # TP rank 1 is not the scheduler that records the workload
    sglang_runner.finish()
    header, events, _ = _ring(runtime_dir, 1)
    assert (header.rank, header.world_size, header.meta["device_index"], header.meta["gpu_total_bytes"]) == (
        1, 2, 1, 48 * GiB)
    assert (header.meta["model"], header.meta["config"]["tensor_parallel_size"],
            header.meta["config"]["data_parallel_size"], header.meta["config"]["dtype"]) == (
        "meta-llama/Llama-3.1-8B", 2, 1, "bfloat16")
    assert dict(events)["rank_identity"]["tp_rank"] == 1


def test_a_runner_given_its_gpu_by_position_reads_that_gpu(
        gpus: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner_class = _install(monkeypatch, gpus[1], parallel={"dp_size": 2, "dp_rank": 1})
    runner_class(model_config(), 0.75, 1, 29500, server_args(dp_size=2, model_path="Qwen/Qwen3-32B"))
    assert process.rank.records_requests is True and process.rank.identity.replica == 1
    sglang_runner.finish()
    header = _ring(runtime_dir, 1)[0]
    assert (header.rank, header.world_size, header.meta["gpu_total_bytes"]) == (1, 2, 48 * GiB)
    assert (header.meta["model"], header.meta["config"]["dtype"]) == ("Qwen/Qwen3-32B", "bfloat16")


def test_with_dp_attention_the_run_counts_replicas_not_attention_groups(
        gpus: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # DP attention over TP 4: SGLang's dp_size 4 is the attention groups; one replica of four GPUs.
    runner_class = _install(monkeypatch, gpus[0], parallel={"tp_size": 4, "attn_dp_size": 4, "dp_rank": 0})
    runner_class(model_config=model_config(), mem_fraction_static=0.75, gpu_id=0, nccl_port=29500,
                 server_args=server_args(tp_size=4, dp_size=4))
    sglang_runner.finish()
    header = _ring(runtime_dir)[0]
    assert (header.world_size, header.meta["config"]["data_parallel_size"]) == (4, 1)


class DraftRunner(ModelRunner):
    """A draft model's runner class of its own, a draft whatever its caller passes."""

    is_draft_worker = True


def test_a_runner_class_that_is_a_draft_starts_no_rank(
        gpus: dict[int, Device], monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, gpus[0], DraftRunner)(model_config(), 0.75, 0, 29500, server_args())
    assert process.rank is None


def test_placement_without_an_attention_tp_rank_records_requests(
        gpus: dict[int, Device], monkeypatch: pytest.MonkeyPatch) -> None:
    context = install_sglang(monkeypatch, gpus[0], ModelRunner)
    del context.parallel.attn_tp_rank  # an SGLang that publishes none
    sglang_runner.install_live()
    sys.modules[RUNNER_MODULE].ModelRunner(model_config(), 0.75, 0, 29500, server_args())
    assert process.rank.records_requests is True


def test_only_the_first_pipeline_stages_attention_tp_rank_0_records_requests(
        gpus: dict[int, Device], monkeypatch: pytest.MonkeyPatch) -> None:
    runner_class = _install(monkeypatch, gpus[0], parallel={"pp_size": 2, "pp_rank": 1})
    runner_class(model_config(), 0.75, 0, 29500, server_args())
    assert process.rank.records_requests is False
    sglang_runner.finish()
    runner_class = _install(monkeypatch, gpus[0], parallel={"attn_tp_rank": None, "tp_size": 2})
    runner_class(model_config(), 0.75, None, 29500, server_args())  # no gpu id: device 0
    assert process.rank.records_requests is True
    assert process.rank.monitor.probe.device_info().total_bytes == 80 * GiB


def test_the_baseline_is_the_free_memory_sglang_measured_before_the_weights(
        gpus: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _install(monkeypatch, gpus[0])(model_config(), 0.75, 0, 29500, server_args())
    gpus[0].allocate(GiB)
    runner.init_torch_distributed()  # called again: its new measurement, less the 3 GiB and 1 GiB since
    named = [data for kind, data in _events(runtime_dir) if kind == "sglang_memory_baseline"]
    assert named == [{"pre_model_load_gb": PRE_GB}, {"pre_model_load_gb": PRE_GB - 4}]


def test_a_resize_with_no_sizing_recorded_passes_through(
        gpus: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner_class = _install(monkeypatch, gpus[0], PostCapture)
    draft = runner_class(model_config(), 0.75, 0, 29500, server_args(), is_draft_worker=True)
    target = runner_class(model_config(), 0.75, 0, 29500, server_args())
    guard.active = False  # the adapter turned itself off: the pool is sized unrecorded
    target.alloc_memory_pool()
    guard.active = True
    target.init_cuda_graphs()
    target.post_capture_resize_kv_pool()  # no sizing to follow
    draft.alloc_memory_pool()
    draft.post_capture_resize_kv_pool()  # a draft's pool
    assert target.max_total_num_tokens < TOKENS
    assert [kind for kind, _ in _events(runtime_dir)].count("kv_allocated") == 0


def test_uninstall_puts_every_class_and_function_back(gpus: dict[int, Device], monkeypatch: pytest.MonkeyPatch) -> None:
    install_sglang(monkeypatch, gpus[0], PostCapture)
    names = (RUNNER_MODULE, CONFIGURATOR_MODULE, POOL_MODULE, RESIZE_MODULE)
    originals = {name: dict(vars(sys.modules[name])) for name in names}
    classes = {(name, attribute): dict(vars(value)) for name in names
               for attribute, value in vars(sys.modules[name]).items() if isinstance(value, type)}
    sglang_runner.install_live()
    runner_class = sys.modules[RUNNER_MODULE].ModelRunner
    assert vars(runner_class)["post_capture_resize_kv_pool"] is not vars(ModelRunner)["post_capture_resize_kv_pool"]
    assert sys.modules[RESIZE_MODULE].get_available_gpu_memory is not originals[RESIZE_MODULE][
        "get_available_gpu_memory"]
    sglang_runner.uninstall()
    assert {name: dict(vars(sys.modules[name])) for name in names} == originals
    assert {(name, attribute): dict(vars(value)) for name in names
            for attribute, value in vars(sys.modules[name]).items() if isinstance(value, type)} == classes


def test_install_patches_modules_already_imported_and_finish_with_no_rank_is_a_no_op(
        gpus: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sglang_runner.finish()
    install_sglang(monkeypatch, gpus[0], PostCapture)
    sglang_runner.install()
    runner = sys.modules[RUNNER_MODULE].ModelRunner(model_config(), 0.75, 0, 29500, server_args())
    runner.alloc_memory_pool()
    runner.init_cuda_graphs()
    runner.post_capture_resize_kv_pool()
    events = _events(runtime_dir)
    assert [data["phase"] for kind, data in events if kind == "phase_start"] == [
        "load", "kv_alloc", "profile", "cudagraph"]
    first, second = [data for kind, data in events if kind == "kv_allocated"]
    # Every module patched: the pool configurator's inputs, and the free memory the resize read.
    assert (first["num_blocks"], first["pool_configurator"]) == (TOKENS, "DefaultPoolConfigurator")
    assert second["post_capture_available_gb"] == 76 + 266 / 1024


class LaterConfigurator(KVCacheConfigurator):
    """A later SGLang's configurator, whose methods take arguments 0.5.23's do not: each must reach the method."""

    seen: ClassVar[list[tuple[Any, ...]]] = []

    def configure(self, tag: str, *, pre_model_load_memory: float, margin_gb: float) -> Any:
        self.seen.append(("configure", tag, margin_gb))
        return self.pooled(self.config_from_budget(self._profile_available_bytes(pre_model_load_memory, tag,
                                                                                 margin_gb=margin_gb)))

    def _profile_available_bytes(self, pre_model_load_memory: float, tag: str, *, margin_gb: float) -> int:
        self.seen.append(("profile", tag, margin_gb))
        return KVCacheConfigurator._profile_available_bytes(self, pre_model_load_memory)

    def config_from_budget(self, budget_bytes: int, *, cap_tokens: int | None = None) -> Any:
        pools = sys.modules[POOL_MODULE]
        return pools.create_memory_pool_configurator(self).calculate_pool_sizes(budget_bytes, 16, "later", margin=0)


class LaterPool(DefaultPoolConfigurator):
    def calculate_pool_sizes(self, available_bytes: int, page_size: int, tag: str, *, margin: int) -> Any:
        LaterConfigurator.seen.append(("pool", tag, margin))
        return DefaultPoolConfigurator.calculate_pool_sizes(self, available_bytes, page_size)


class LaterRunner(PostCapture):
    def __init__(self, model_config: Any, mem_fraction_static: float, gpu_id: int, nccl_port: int,
                 server_args: Any, is_draft_worker: bool = False) -> None:
        self.model_config, self.mem_fraction_static, self.gpu_id = model_config, mem_fraction_static, gpu_id
        self.server_args, self.is_draft_worker, self.is_hybrid_swa = server_args, is_draft_worker, False
        self.device, self.page_size = "cuda", server_args.page_size
        self.init_torch_distributed("later", timeout=30)
        self.load_model("later", eager=True)

    def init_torch_distributed(self, tag: str, *, timeout: int) -> None:
        LaterConfigurator.seen.append(("distributed", tag, timeout))
        ModelRunner.init_torch_distributed(self)

    def load_model(self, tag: str, *, eager: bool) -> None:
        LaterConfigurator.seen.append(("load", tag, eager))
        ModelRunner.load_model(self)

    def init_cuda_graphs(self, capture_decode_cuda_graph: bool, *, tag: str) -> None:
        LaterConfigurator.seen.append(("graphs", capture_decode_cuda_graph, tag))
        ModelRunner.init_cuda_graphs(self)

    def alloc_memory_pool(self, memory_pool_config: Any = None) -> None:
        self.kv_cache_configurator = sys.modules[CONFIGURATOR_MODULE].KVCacheConfigurator(self, False)
        result = self.kv_cache_configurator.configure("later", pre_model_load_memory=self.pre_model_load_memory,
                                                      margin_gb=0.5)
        self.max_total_num_tokens, self.max_running_requests = result.max_total_num_tokens, result.max_running_requests
        self.token_to_kv_pool = result.token_to_kv_pool

    def post_capture_resize_kv_pool(self, tag: str, *, draft_runners: tuple[Any, ...] = ()) -> None:
        LaterConfigurator.seen.append(("resize", tag, draft_runners))
        ModelRunner.post_capture_resize_kv_pool(self, draft_runners=draft_runners)


def test_arguments_a_later_sglang_adds_reach_its_methods(
        gpus: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_sglang(monkeypatch, gpus[0], LaterRunner)
    monkeypatch.setattr(sys.modules[CONFIGURATOR_MODULE], "KVCacheConfigurator", LaterConfigurator)
    monkeypatch.setattr(sys.modules[POOL_MODULE], "DefaultPoolConfigurator", LaterPool)
    monkeypatch.setattr(LaterConfigurator, "seen", [])
    sglang_runner.install_live()
    runner_class = sys.modules[RUNNER_MODULE].ModelRunner
    target = runner_class(model_config(), 0.75, 0, 29500, server_args())
    draft = runner_class(model_config(), 0.75, 0, 29500, server_args(), is_draft_worker=True)
    for runner in (target, draft):
        runner.alloc_memory_pool()
        runner.init_cuda_graphs(False, tag="later")
        runner.post_capture_resize_kv_pool("again", draft_runners=("eagle",))
    started = [("distributed", "later", 30), ("load", "later", True)] * 2
    assert LaterConfigurator.seen == started + [
        ("configure", "later", 0.5), ("profile", "later", 0.5), ("pool", "later", 0), ("graphs", False, "later"),
        ("resize", "again", ("eagle",)), ("pool", "later", 0)] * 2
    events = _events(runtime_dir)
    assert [data.get("sizing_event") for kind, data in events if kind == "kv_allocated"] == [None, "post_capture"]
    assert [data["page_size"] for kind, data in events if kind == "kv_allocated"] == [16, 16]


def test_a_drafts_resize_after_the_targets_sizing_is_not_recorded(
        gpus: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner_class = _install(monkeypatch, gpus[0], PostCapture)
    target = runner_class(model_config(), 0.75, 0, 29500, server_args())
    draft = runner_class(model_config(), 0.75, 0, 29500, server_args(), is_draft_worker=True)
    target.alloc_memory_pool()
    draft.alloc_memory_pool()
    draft.post_capture_resize_kv_pool()
    kinds = [data.get("sizing_event") for kind, data in _events(runtime_dir) if kind == "kv_allocated"]
    assert kinds == [None]


def test_a_pool_module_without_the_sliding_window_configurators_is_patched_and_one_without_their_cells_is_not(
        gpus: dict[int, Device], monkeypatch: pytest.MonkeyPatch) -> None:
    install_sglang(monkeypatch, gpus[0], ModelRunner)
    pools = sys.modules[POOL_MODULE]
    hybrid = pools.HybridSWAPoolConfigurator
    for name in ("HybridSWAPoolConfigurator", "SWARequestCapPoolConfigurator"):
        monkeypatch.delattr(pools, name)  # an SGLang before sliding-window pools
    sizing._patch_pool_configurator(pools)
    assert getattr(vars(pools.DefaultPoolConfigurator)["calculate_pool_sizes"], hooks.WRAPPED)
    monkeypatch.setattr(pools, "HybridSWAPoolConfigurator", type("HybridSWAPoolConfigurator", (), {
        "calculate_pool_sizes": vars(hybrid)["calculate_pool_sizes"]}), raising=False)  # no cells of its own
    with pytest.raises(AttributeError, match="_full_cell_bytes, _swa_cell_bytes"):
        sizing._patch_pool_configurator(pools)
