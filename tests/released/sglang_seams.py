"""What stands in for the GPU under the released SGLang (``sglang_driver.py``): the device seams, on CPU.

* ``torch.cuda``'s memory API answers from ``fake_cuda``; a tensor asked for on ``cuda`` is made on
  the CPU and its bytes are taken from the fake device (a ``TorchFunctionMode``), so SGLang's own
  pools fill the device memory memwatch reads; no host memory is page-locked; ``torch.cuda.Stream``
  is inert;
* ``ModelRunner.init_torch_distributed`` and ``bootstrap.init_parallel_runtime`` (device bring-up: NCCL
  groups, the gated launch) are replaced by ones that measure ``pre_model_load_memory`` as SGLang's
  does (``get_available_gpu_memory``, the minimum over the ranks through a gloo group when there are
  several) and state the groups;
* ``ModelRunner.load_model`` (the weights) takes ``WEIGHTS_BYTES`` of the device and sets what SGLang's
  sets (model, dtype, the sliding window as SGLang resolves it); ``init_cuda_graphs`` (graph capture)
  takes ``GRAPHS_BYTES`` and captures nothing; ``TpModelWorker.forward_batch_generation`` (the model's
  forward and sampling) returns token 7 for every request;
* torchvision's two operator schemas its CUDA-built ``_C`` library would define are declared, since
  that library cannot load next to CPU PyTorch.
"""

from __future__ import annotations

import contextlib
import socket
import weakref
from types import SimpleNamespace
from typing import Any

MiB = 1 << 20
WEIGHTS_BYTES = 24 * MiB
GRAPHS_BYTES = 4 * MiB


def cuda_seams() -> None:
    import fake_cuda
    import torch
    from torch.overrides import TorchFunctionMode

    def properties(index: Any = None) -> Any:
        return SimpleNamespace(name="Fake GPU", total_memory=fake_cuda.device(index).total, is_integrated=False,
                               major=9, minor=0, multi_processor_count=132)

    class Stream:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def wait_stream(self, *args: Any) -> None:
            pass

        def synchronize(self) -> None:
            pass

    def is_cuda(device: Any) -> bool:
        try:
            return device is not None and not isinstance(device, bool) and torch.device(device).type == "cuda"
        except (RuntimeError, TypeError):
            return False

    class CudaOnCpu(TorchFunctionMode):
        """Tensors asked for on ``cuda`` live on the CPU, their bytes taken from the fake device; no host memory is
        page-locked."""

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.pin_memory:  # page-locked host memory is the driver's
                return args[0]
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            moved = False
            if is_cuda(kwargs.get("device")):
                kwargs["device"], moved = "cpu", True
            if func is torch.Tensor.to and args[1:] and is_cuda(args[1]):
                args, moved = (args[0], "cpu", *args[2:]), True
            out = func(*args, **kwargs)
            if moved and isinstance(out, torch.Tensor) and out.numel():
                weakref.finalize(out, fake_cuda.empty(out.untyped_storage().nbytes()).free)
            return out

    torch.cuda.get_device_properties = properties
    torch.cuda.Stream = Stream
    torch.cuda.current_stream = lambda *args, **kwargs: Stream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    CudaOnCpu().__enter__()
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _keep.append(library)


_keep: list[Any] = []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _group(size: int, rank: int, cpu_group: Any = None) -> Any:
    return SimpleNamespace(world_size=size, rank_in_group=rank, rank=rank, is_first_rank=rank == 0,
                           is_last_rank=rank == size - 1, cpu_group=cpu_group, device_group=cpu_group,
                           ranks=list(range(size)), first_rank=0, last_rank=size - 1, local_rank=rank)


def runner_seams() -> None:
    import fake_cuda
    import torch
    from sglang.srt.distributed import bootstrap
    from sglang.srt.model_executor import model_runner
    from sglang.srt.model_executor.model_runner_components.load_model_utils import resolve_sliding_window_size
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.common import get_available_gpu_memory

    class Model(torch.nn.Module):
        def __init__(self, layers: int) -> None:
            super().__init__()
            self.start_layer, self.end_layer = 0, layers

        def forward(self, input_ids: Any, positions: Any, forward_batch: Any) -> Any:
            raise NotImplementedError("the driver's scheduler runs the model's output itself")

    def init_parallel_runtime(**settings: Any) -> None:
        parallel = get_parallel()
        if not torch.distributed.is_initialized():  # one rank: its own gloo group (TP ranks start theirs first)
            torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                                 world_size=1)
        world = torch.distributed.group.WORLD
        tp = _group(parallel.tp_size, parallel.tp_rank, world)
        attn_tp = tp if parallel.attn_tp_size == parallel.tp_size else _group(parallel.attn_tp_size,
                                                                                parallel.attn_tp_rank)
        parallel.override_permanently(tp_group=tp, pp_group=_group(1, 0), attn_tp_group=attn_tp,
                                      attn_cp_group=_group(1, 0), moe_ep_group=_group(1, 0), world_group=tp)

    def init_torch_distributed(self: Any) -> None:
        parallel = get_parallel()
        init_parallel_runtime()
        self.pre_model_load_memory = get_available_gpu_memory(
            self.device, self.gpu_id, distributed=parallel.tp_size > 1, cpu_group=torch.distributed.group.WORLD)
        self.pp_group = parallel.pp_group

    def load_model(self: Any) -> None:
        self.weights = fake_cuda.empty(WEIGHTS_BYTES)
        self.model = Model(self.model_config.num_hidden_layers)
        self.loader = SimpleNamespace(preloaded_weights_bytes=0)  # nothing loaded ahead of the runner
        self.startup_weight_load = None
        self.sliding_window_size = resolve_sliding_window_size(self.model, self.model_config)  # SGLang's own
        self.prefill_aware_swa = False
        self.dtype = self.model_config.dtype

    def init_cuda_graphs(self: Any, capture_decode_cuda_graph: bool = True) -> None:
        self.graphs = fake_cuda.empty(GRAPHS_BYTES)  # the graph pool; the driver's forward runs eagerly
        self.eager_runner = self.prefill_cuda_graph_runner = self.decode_cuda_graph_runner = None
        self.decode_cuda_graph_captured, self.decode_cuda_graph_capture_bs = False, []
        self.graph_memory_usage, self.graph_time_usage = {}, {}

    bootstrap.init_parallel_runtime = init_parallel_runtime
    model_runner.ModelRunner.init_cuda_graphs = init_cuda_graphs
    model_runner.ModelRunner.init_torch_distributed = init_torch_distributed
    model_runner.ModelRunner.load_model = load_model


def forward_seam() -> None:
    """The model's forward and sampling: token 7 for every request of a batch."""
    import torch
    from sglang.srt.managers import tp_worker
    from sglang.srt.managers.utils import GenerationBatchResult

    def forward_batch_generation(self: Any, batch: Any = None, forward_batch: Any = None, *args: Any,
                                 **kwargs: Any) -> Any:
        return GenerationBatchResult(next_token_ids=torch.full((batch.batch_size(),), 7, dtype=torch.int64),
                                     can_run_cuda_graph=False)

    tp_worker.TpModelWorker.forward_batch_generation = forward_batch_generation


VMM_GRANULARITY = 2 * MiB


def post_capture_seams() -> None:
    """``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1`` on the fake device: the setting alone decides
    (``is_post_capture_kv_active``; SGLang's own gate also asks for a CUDA platform and captured decode and
    prefill graphs, which a CPU run cannot have), and the KV pool's virtual-memory
    backing (``KvVmmBufferOwner``: address space reserved for the largest pool, memory committed in
    granules of 2 MiB as SGLang backs a span) with buffers on the CPU and each committed granule mapped on
    the fake device as the driver maps it (``cuMemCreate``/``cuMemMap``): in the device's used memory, in
    none of the caching allocator's counters. The resize itself is SGLang's: ``post_capture_resize_kv_pool``
    reads the free memory after capture, sizes a budget and calls the configurator, the pool and the allocator."""
    import fake_cuda
    import torch
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.model_executor import model_runner

    def is_post_capture_kv_active(*, server_args: Any, is_draft_worker: bool, **kwargs: Any) -> bool:
        return not is_draft_worker and envs.SGLANG_ENABLE_POST_CAPTURE_KV_SIZING.get()

    class Backing:
        def __init__(self, *, device: str, device_id: int, store_dtype: Any, page_size: int,
                     reserved_num_tokens: int, buffer_descs: Any) -> None:
            self.page_size, self.reserved = int(page_size), int(reserved_num_tokens)
            self.descs = list(buffer_descs)
            self.tensors = [torch.empty(d.shape, dtype=store_dtype, device="cpu") for d in self.descs]
            self.backed = [0] * len(self.descs)
            self.granules: list[Any] = []
            self.ensure_prefix(self.page_size)

        def _back(self, spans: list[int]) -> None:
            for index, span in enumerate(spans):
                want = -(-int(span) // VMM_GRANULARITY) * VMM_GRANULARITY
                if want > self.backed[index]:
                    self.granules.append(fake_cuda.map_outside_allocator(want - self.backed[index]))
                    self.backed[index] = want

        def ensure_prefix(self, num_tokens: int) -> None:
            self._back([d.prefix_span_bytes(num_tokens, self.page_size) for d in self.descs])

        def finalize(self, final_num_tokens: int) -> None:
            self._back([d.final_span_bytes(int(final_num_tokens), self.page_size) for d in self.descs])

        @property
        def backed_bytes(self) -> int:
            return sum(self.backed)

        def close(self) -> None:
            for granule in self.granules:
                granule.unmap()
            self.granules, self.tensors = [], []

    model_runner.is_post_capture_kv_active = is_post_capture_kv_active
    memory_pool.KvVmmBufferOwner = Backing
