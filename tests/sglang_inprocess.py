"""SGLang 0.5.23's model runner, KV-cache configurator and pool configurators in short, in process, on a stand-in GPU.

The shapes are SGLang's by the seams the adapter patches:

* ``sglang.srt.runtime_context``: ``get_parallel()`` (placement), ``get_schedule()`` (``mem_fraction_static``,
  ``page_size``, ``chunked_prefill_size``, ``max_prefill_tokens``, ``max_total_tokens``), ``get_memory()``
  (``enable_unified_memory``);
* ``mem_cache/kv_cache_configurator.py``: ``KVCacheConfigurator.configure(*, pre_model_load_memory)`` profiles
  (``_profile_available_bytes``: ``get_available_gpu_memory`` − ``pre_model_load_memory × (1 − mem_fraction_static)``
  − ``mm_runtime_reservation_gb``, in GB of 2³⁰ bytes, to bytes), then ``config_from_budget`` asks the pool
  configurator ``create_memory_pool_configurator`` picks for ``calculate_pool_sizes(budget, page_size)``, allocates
  the token pool and logs the free memory once more (``get_available_gpu_memory``, not a sizing input);
* ``model_executor/pool_configurator.py``: ``DefaultPoolConfigurator`` (``_cell_size`` a token of every layer,
  ``_fixed_overhead_bytes``; tokens = ``(budget − overhead) // cell`` in whole pages), ``HybridSWAPoolConfigurator``
  (full pool of ``budget // (full cell + ratio × sliding cell)`` tokens, sliding pool ``ratio ×`` that, both in
  whole pages) and its subclass ``SWARequestCapPoolConfigurator``;
* ``model_executor/model_runner.py``: ``ModelRunner.__init__`` (``model_config, mem_fraction_static, gpu_id,
  nccl_port, server_args, is_draft_worker=False, …``) runs ``init_torch_distributed`` (``pre_model_load_memory``:
  the free GB before the weights) and ``load_model``; the scheduler then calls ``alloc_memory_pool``,
  ``init_cuda_graphs`` and, with post-capture KV sizing, ``post_capture_resize_kv_pool``, which
  (``kv_pool_runtime.compute_post_capture_kv_resize``) reads ``get_available_gpu_memory`` again, budgets
  ``free − headroom − multimodal reservation`` plus the bytes the pool backs already, sizes through
  ``config_from_budget`` capped at the first count, and backs the final span (``finalize_backing``).

A post-capture pool (``MHATokenToKVPool`` with a ``KvVmmBufferOwner``) reserves address space and backs only its
first page through the driver's virtual-memory API, in 2 MiB granules; ``post_capture_backed_bytes`` says how much.
"""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

from cuda_params import Tensor
from test_vllm_gpu_worker import SEGMENT, Device, _round_up

GiB = 1 << 30
RUNTIME_MODULE = "sglang.srt.runtime_context"
CONFIGURATOR_MODULE = "sglang.srt.mem_cache.kv_cache_configurator"
POOL_MODULE = "sglang.srt.model_executor.pool_configurator"
RUNNER_MODULE = "sglang.srt.model_executor.model_runner"
RESIZE_MODULE = "sglang.srt.model_executor.model_runner_components.kv_pool_runtime"


def _module(name: str) -> Any:
    """A module global as SGLang's code reads it: through its module, so that a wrapped one is what runs."""
    module_name, _, attribute = name.rpartition(".")
    return getattr(sys.modules[module_name], attribute)


class TokenPool:
    """``MHATokenToKVPool``: K and V buffers of ``size + page_size`` tokens; a post-capture pool backs only its
    first page now, through the driver."""

    def __init__(self, gpu: Device, size: int, page_size: int, cell: int, post_capture: bool,
                 swa: tuple[int, int] = (0, 0)) -> None:
        self.gpu, self.size, self.page_size, self.cell = gpu, size, page_size, cell
        self.swa_size, self.swa_cell = swa  # ``SWAKVPool``: the sliding-window layers' pool beside the full one
        self.post_capture_active = post_capture
        self.post_capture_backed_bytes = 0
        if post_capture:
            self._back(page_size, page_size)
        else:
            gpu.allocate(sum(self.get_kv_size_bytes()))

    def _back(self, tokens: int, swa_tokens: int) -> None:
        """Each sub-pool's buffer owner backs its span in whole granules."""
        backed = _round_up(tokens * self.cell, SEGMENT) + _round_up(swa_tokens * self.swa_cell, SEGMENT)
        self.gpu.mapped += backed - self.post_capture_backed_bytes
        self.post_capture_backed_bytes = backed

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """K and V bytes, each pool's ``size + page_size`` tokens."""
        half = ((self.size + self.page_size) * self.cell + (self.swa_size + self.page_size) * self.swa_cell
                if self.swa_cell else (self.size + self.page_size) * self.cell) // 2
        return half, half

    def finalize_backing(self, config: Any) -> None:
        self._back(config.max_total_num_tokens, config.swa_max_total_num_tokens or 0)
        self.size, self.swa_size = int(config.max_total_num_tokens), int(config.swa_max_total_num_tokens or 0)


class KVCacheConfigurator:
    def __init__(self, runner: Any, is_hybrid_swa: bool) -> None:
        self.runner, self.device, self.gpu_id = runner, "cuda", runner.gpu_id
        self.model_config, self.server_args = runner.model_config, runner.server_args
        self.page_size = _module(f"{RUNTIME_MODULE}.get_schedule")().page_size
        self.pp_size = _module(f"{RUNTIME_MODULE}.get_parallel")().pp_size
        self.is_draft_worker, self.is_hybrid_swa = runner.is_draft_worker, is_hybrid_swa
        self.mambaish_config = None
        self.post_capture_kv_active = runner.post_capture

    def configure(self, *, pre_model_load_memory: float) -> Any:
        return self.pooled(self.config_from_budget(self._profile_available_bytes(pre_model_load_memory)))

    def pooled(self, config: Any) -> Any:
        """The pools of ``config`` allocated: ``configure``'s result."""
        runner = self.runner
        swa = (config.swa_max_total_num_tokens, runner.swa_per_token * runner.swa_layers) if self.is_hybrid_swa \
            else (0, 0)
        full = config.full_max_total_num_tokens if self.is_hybrid_swa else config.max_total_num_tokens
        cell = runner.full_per_token * runner.full_layers if self.is_hybrid_swa else runner.cell
        pool = TokenPool(runner.gpu, full, self.page_size, cell, self.post_capture_kv_active, swa)
        for name in runner.pool_lacks:  # a pool class of another shape
            if name in vars(pool):
                delattr(pool, name)
            else:
                setattr(pool, name, None)  # a method it does not have
        _module(f"{CONFIGURATOR_MODULE}.get_available_gpu_memory")(self.device, self.gpu_id)  # "Memory pool end."
        return SimpleNamespace(max_total_num_tokens=config.max_total_num_tokens,
                               max_running_requests=self.server_args.max_running_requests,
                               full_max_total_num_tokens=config.full_max_total_num_tokens,
                               swa_max_total_num_tokens=config.swa_max_total_num_tokens, token_to_kv_pool=pool)

    def _profile_available_bytes(self, pre_model_load_memory: float) -> int:
        available = _module(f"{CONFIGURATOR_MODULE}.get_available_gpu_memory")(self.device, self.gpu_id,
                                                                              distributed=False, cpu_group=None)
        slack = pre_model_load_memory * (1 - _module(f"{RUNTIME_MODULE}.get_schedule")().mem_fraction_static)
        reserved = _module(f"{CONFIGURATOR_MODULE}.mm_runtime_reservation_gb")(
            is_multimodal=self.model_config.is_multimodal, mm_feature_transport=None)
        return int((available - slack - reserved) * GiB)

    def config_from_budget(self, budget_bytes: int, *, cap_tokens: int | None = None) -> Any:
        configurator = _module(f"{POOL_MODULE}.create_memory_pool_configurator")(self)
        config = configurator.calculate_pool_sizes(budget_bytes, _module(f"{RUNTIME_MODULE}.get_schedule")().page_size)
        if cap_tokens is not None and config.max_total_num_tokens > cap_tokens:
            config = SimpleNamespace(**{**vars(config), "max_total_num_tokens": cap_tokens})
        return config


def _pool_config(tokens: int, full: int | None = None, swa: int | None = None) -> SimpleNamespace:
    """``MemoryPoolConfig``."""
    return SimpleNamespace(max_total_num_tokens=tokens, full_max_total_num_tokens=full, swa_max_total_num_tokens=swa)


class DefaultPoolConfigurator:
    def __init__(self, kvc: KVCacheConfigurator) -> None:
        self._cell_size, self._fixed_overhead_bytes = kvc.runner.cell, kvc.runner.overhead

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> Any:
        available_bytes = max(available_bytes - self._fixed_overhead_bytes, 0)
        return _pool_config(available_bytes // self._cell_size // page_size * page_size)


class HybridSWAPoolConfigurator:
    def __init__(self, kvc: KVCacheConfigurator) -> None:
        runner = kvc.runner
        self._full_layers_num, self._full_per_token = runner.full_layers, runner.full_per_token
        self._swa_layers_num, self._swa_per_token = runner.swa_layers, runner.swa_per_token
        self._swa_full_tokens_ratio = runner.swa_ratio
        self._enable_unified_memory = _module(f"{RUNTIME_MODULE}.get_memory")().enable_unified_memory
        self._draft_full_layers_num = self._draft_swa_layers_num = self._draft_swa_full_layers_num = 0
        self._draft_cell_size = runner.draft_cell
        self._fused_full_entry = self._fused_swa_entry = None
        self._cell_size = (self._full_cell_bytes() + self._swa_full_tokens_ratio * self._swa_cell_bytes()
                           + self._draft_cell_size if self._full_layers_num else self._swa_cell_bytes())

    def _full_cell_bytes(self) -> int:
        return self._full_per_token * (self._full_layers_num + self._draft_full_layers_num)

    def _swa_cell_bytes(self) -> int:
        return self._swa_per_token * (self._swa_layers_num + self._draft_swa_layers_num)

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> Any:
        tokens = int(available_bytes // self._cell_size) // page_size * page_size
        if not self._full_layers_num:  # all sliding-window layers: no full pool, no ratio
            return _pool_config(tokens, 0, tokens)
        return _pool_config(tokens, tokens, int(tokens * self._swa_full_tokens_ratio) // page_size * page_size)


class SWARequestCapPoolConfigurator(HybridSWAPoolConfigurator):
    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> Any:
        return HybridSWAPoolConfigurator.calculate_pool_sizes(self, available_bytes, page_size)


class DSV4PoolConfigurator:
    """DeepSeek V4's: a ``calculate_pool_sizes`` of its own, which memwatch does not wrap, and neither a fixed
    overhead nor sliding-window cells to read."""

    def __init__(self, kvc: KVCacheConfigurator) -> None:
        self._bytes_per_token = kvc.runner.cell

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> Any:
        return _pool_config(available_bytes // self._bytes_per_token // page_size * page_size)


def create_memory_pool_configurator(kvc: KVCacheConfigurator) -> Any:
    pools = sys.modules[POOL_MODULE]
    if kvc.runner.dsv4:
        return pools.DSV4PoolConfigurator(kvc)
    if kvc.is_hybrid_swa:
        return (pools.SWARequestCapPoolConfigurator if kvc.runner.request_cap else pools.HybridSWAPoolConfigurator)(kvc)
    return pools.DefaultPoolConfigurator(kvc)


class Model:
    """The loaded model: its weights in two CUDA storages, the embedding tied to the output head (one storage)."""

    def __init__(self, nbytes: int) -> None:
        embedding = Tensor(1, 1 << 20)
        self._parameters = [embedding, Tensor(2, nbytes - (1 << 20)), embedding]

    def parameters(self) -> list[Tensor]:
        return self._parameters

    def buffers(self) -> list[Tensor]:
        return []


class ModelRunner:
    """``ModelRunner`` by its seams; the class attributes are the scenario's model (what SGLang reads off its
    config) and the device it runs on."""

    gpu: Device
    weights = 3 * GiB
    graphs = 256 << 20
    cell = 24 * 8 * 128 * 2 * 2  # 24 layers × 8 KV heads × dim 128 × K and V × 2 bytes: 96 KiB a token
    overhead = 0
    post_capture = False
    hybrid = request_cap = dsv4 = False
    full_layers = swa_layers = 0
    full_per_token = swa_per_token = draft_cell = 0
    swa_ratio = 0.8
    pool_lacks: tuple[str, ...] = ()

    def __init__(self, model_config: Any, mem_fraction_static: float, gpu_id: int, nccl_port: int,
                 server_args: Any, is_draft_worker: bool = False, req_to_token_pool: Any = None) -> None:
        self.model_config, self.mem_fraction_static, self.gpu_id = model_config, mem_fraction_static, gpu_id
        self.server_args, self.is_draft_worker, self.is_hybrid_swa = server_args, is_draft_worker, self.hybrid
        self.device, self.page_size = "cuda", server_args.page_size
        self.init_torch_distributed()
        self.load_model()

    def init_torch_distributed(self) -> None:
        self.pre_model_load_memory = self.gpu.mem_get_info()[0] / GiB

    def load_model(self) -> None:
        self.gpu.allocate(self.weights)
        self.model = Model(self.weights)

    def alloc_memory_pool(self, memory_pool_config: Any = None) -> None:
        configurator_class = sys.modules[CONFIGURATOR_MODULE].KVCacheConfigurator
        self.kv_cache_configurator = configurator_class(self, self.hybrid)
        result = self.kv_cache_configurator.configure(pre_model_load_memory=self.pre_model_load_memory)
        self.max_total_num_tokens, self.max_running_requests = result.max_total_num_tokens, result.max_running_requests
        self.token_to_kv_pool = result.token_to_kv_pool
        self.token_to_kv_pool_allocator = SimpleNamespace(size=result.max_total_num_tokens)
        if self.is_hybrid_swa:
            self.full_max_total_num_tokens = result.full_max_total_num_tokens
            self.swa_max_total_num_tokens = result.swa_max_total_num_tokens

    def init_cuda_graphs(self, capture_decode_cuda_graph: bool = True) -> None:
        self.gpu.allocate(self.graphs)

    def post_capture_resize_kv_pool(self, *, draft_runners: tuple[Any, ...] = ()) -> None:
        pool = self.token_to_kv_pool
        free = _module(f"{RESIZE_MODULE}.get_available_gpu_memory")(self.device, self.gpu_id)
        headroom = self.pre_model_load_memory * (1 - self.mem_fraction_static)
        reserved = _module(f"{CONFIGURATOR_MODULE}.mm_runtime_reservation_gb")(
            is_multimodal=self.model_config.is_multimodal, mm_feature_transport=None)
        budget = int(max(0.0, free - headroom - reserved) * GiB) + pool.post_capture_backed_bytes
        config = self.kv_cache_configurator.config_from_budget(budget, cap_tokens=self.max_total_num_tokens)
        pool.finalize_backing(config)
        self.max_total_num_tokens = config.max_total_num_tokens
        if self.is_hybrid_swa:
            self.full_max_total_num_tokens = config.full_max_total_num_tokens
            self.swa_max_total_num_tokens = config.swa_max_total_num_tokens


def install_sglang(monkeypatch: Any, gpu: Device, runner: type[ModelRunner], *, parallel: dict[str, Any] | None = None,
                   schedule: dict[str, Any] | None = None, unified_memory: bool = False,
                   mm_reservation_gb: float = 0.0) -> SimpleNamespace:
    """SGLang's modules in ``sys.modules`` (fresh classes each time: wrapping changes them); what they publish."""
    published = SimpleNamespace(
        parallel=SimpleNamespace(**{"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1,
                                    "dp_rank": None, "attn_dp_size": 1, "attn_dp_rank": 0, "attn_tp_rank": 0,
                                    **(parallel or {})}),
        schedule=SimpleNamespace(**{"mem_fraction_static": 0.75, "page_size": 16, "chunked_prefill_size": 8192,
                                    "max_prefill_tokens": 16384, "max_total_tokens": None, **(schedule or {})}),
        memory=SimpleNamespace(enable_unified_memory=unified_memory))
    modules = {name: ModuleType(name) for name in ("sglang", "sglang.srt", RUNTIME_MODULE, CONFIGURATOR_MODULE,
                                                   POOL_MODULE, RUNNER_MODULE, RESIZE_MODULE)}
    modules[RUNTIME_MODULE].get_parallel = lambda: published.parallel
    modules[RUNTIME_MODULE].get_schedule = lambda: published.schedule
    modules[RUNTIME_MODULE].get_memory = lambda: published.memory

    def get_available_gpu_memory(device: str, gpu_id: int, distributed: bool = False, cpu_group: Any = None) -> float:
        return gpu.mem_get_info()[0] / GiB

    def mm_runtime_reservation_gb(*, is_multimodal: bool, mm_feature_transport: str | None) -> float:
        return mm_reservation_gb if is_multimodal else 0.0

    configurators = modules[CONFIGURATOR_MODULE]
    configurators.KVCacheConfigurator = type("KVCacheConfigurator", (KVCacheConfigurator,), {
        "configure": KVCacheConfigurator.configure,
        "_profile_available_bytes": KVCacheConfigurator._profile_available_bytes})
    configurators.get_available_gpu_memory = get_available_gpu_memory
    configurators.mm_runtime_reservation_gb = mm_runtime_reservation_gb
    pools = modules[POOL_MODULE]
    pools.DefaultPoolConfigurator = type("DefaultPoolConfigurator", (DefaultPoolConfigurator,),
                                         {"calculate_pool_sizes": DefaultPoolConfigurator.calculate_pool_sizes})
    pools.HybridSWAPoolConfigurator = type("HybridSWAPoolConfigurator", (HybridSWAPoolConfigurator,), {
        name: vars(HybridSWAPoolConfigurator)[name]
        for name in ("calculate_pool_sizes", "_full_cell_bytes", "_swa_cell_bytes")})
    pools.SWARequestCapPoolConfigurator = type("SWARequestCapPoolConfigurator", (pools.HybridSWAPoolConfigurator,), {
        "calculate_pool_sizes": SWARequestCapPoolConfigurator.calculate_pool_sizes})
    pools.DSV4PoolConfigurator = DSV4PoolConfigurator
    pools.create_memory_pool_configurator = create_memory_pool_configurator
    modules[RESIZE_MODULE].get_available_gpu_memory = get_available_gpu_memory
    modules[RUNNER_MODULE].ModelRunner = type("ModelRunner", (runner,), {
        name: getattr(runner, name) for name in ("__init__", "init_torch_distributed", "load_model",
                                                 "alloc_memory_pool", "init_cuda_graphs",
                                                 "post_capture_resize_kv_pool")})
    modules[RUNNER_MODULE].ModelRunner.gpu = gpu
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return published


def model_config(context_len: int = 4096, is_multimodal: bool = False) -> SimpleNamespace:
    return SimpleNamespace(dtype="torch.bfloat16", context_len=context_len, is_multimodal=is_multimodal)


def server_args(**values: Any) -> SimpleNamespace:
    return SimpleNamespace(**{"model_path": "Qwen/Qwen3-8B", "kv_cache_dtype": "auto", "tp_size": 1, "pp_size": 1,
                              "dp_size": 1, "mem_fraction_static": 0.75, "page_size": 16, "max_total_tokens": None,
                              "max_running_requests": 48, "chunked_prefill_size": 8192, "max_prefill_tokens": 16384,
                              "disable_radix_cache": False, "disable_cuda_graph": False, **values})
