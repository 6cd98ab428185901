"""Drive a released vLLM (0.33.0 or 0.34.0, installed by ``make engines``) through memwatch's plugin, on CPU.

Run as ``python vllm_driver.py MODE MODEL_DIR [ARG]``; prints one JSON line of what it saw (``loop``:
lines of its own). vLLM's own
code runs throughout: its plugin loader, ``VllmConfig``/``ParallelConfig``, the KV-cache planner
(``kv_cache_planning``), the ``Worker`` class (``__init__``, ``initialize_from_config``,
``shutdown``), ``allocate_kv_cache`` (on CPU tensors) and the engine core's ``Scheduler`` with real
``Request``/``SchedulerOutput``/``ModelRunnerOutput`` objects. Two seams stand where the GPU is
missing: ``torch.cuda``'s memory API answers from ``fake_cuda``, and ``Worker.init_device`` (device
bring-up, NCCL, the model runner) is replaced before memwatch patches the class by one that sets what
vLLM's sets: ``device``, ``init_snapshot``, ``requested_memory`` (vLLM's ``request_memory``) and a
model runner whose ``initialize_kv_cache`` calls vLLM's ``allocate_kv_cache`` (both in ``vllm_seams.py``).

"on" runs data parallelism 2 × tensor parallelism 2 of a hybrid model (full and sliding-window
attention layers, two KV cache groups): engine 0 gets 4 MiB of KV memory per worker, engine 1 gets
1.5 MiB; engine 0 runs without stats, as offline ``LLM(...)`` does, and engine 1 with them, as a served
engine does, serving three prompts that cannot all keep their blocks (preemptions) and speculative
decoding steps (two draft tokens each). "on" and "off" also ask vLLM's own ``AsyncLLM.__init__`` what
``log_stats`` it settles on for an engine served with stats off.

"workload BLOCK_SIZE" runs one engine on one GPU (TP 1, as vLLM's ``UniProcExecutor`` runs the worker
in the engine core) whose real ``Worker.execute_model`` runs on vLLM's process groups over gloo: eight
requests arriving one every four steps. "engine-core" serves the same requests from an engine core
with TP 2 whose two workers start and get their KV cache in processes of their own. "dense-dp" runs the
data parallelism 2 × tensor parallelism 2 a dense model gets when served: two engine-core processes, each
through vLLM's ``run_engine_core`` (which makes each engine an independent DP rank). "override BLOCKS"
runs one TP 2 engine given ``num_gpu_blocks_override``. "extensible BLOCKS,BLOCKS" (0.34) runs one TP 2 engine
with the extensible KV cache, its two workers measuring those block counts after warmup. "loop STOP_FILE"
is that one-GPU engine started with memwatch off, serving rounds of requests until STOP_FILE exists: a
target for ``attach --inject``.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from fake_device import load_fake_cuda
from vllm_seams import (
    MiB,
    cpu_extensible_kv_cache,
    cpu_init_device,
    make_config,
    plan_kv,
    serve,
    triton_as_on_a_gpu_host,
    weights_and_warmup,
)

WRAPPED = "__memwatch_wrapped__"


def _wrapped(cls: type) -> list[str]:
    return sorted(name for name, value in vars(cls).items() if getattr(value, WRAPPED, False))


class _RendererReached(Exception):
    """``AsyncLLM.__init__`` asked for its renderer: ``log_stats`` is decided by then."""


def _async_llm_log_stats(config: Any) -> bool:
    """``log_stats`` as ``AsyncLLM.__init__`` decides it for an engine served with ``--disable-log-stats``.

    vLLM's own constructor runs up to its renderer (the first thing that needs a tokenizer), where the
    driver stops it: by then it has loaded the stat logger plugins and set ``log_stats``.
    """
    from vllm.v1.engine import async_llm

    def stop(*args: Any, **kwargs: Any) -> Any:
        raise _RendererReached

    engine = object.__new__(async_llm.AsyncLLM)
    renderer_from_config, async_llm.renderer_from_config = async_llm.renderer_from_config, stop
    try:
        async_llm.AsyncLLM.__init__(engine, config, executor_class=None, log_stats=False)
    except _RendererReached:
        pass
    finally:
        async_llm.renderer_from_config = renderer_from_config
    return engine.log_stats


def main() -> None:
    mode, model = sys.argv[1], sys.argv[2]
    load_fake_cuda()
    facts: dict[str, Any] = {}
    from vllm.v1.worker import gpu_worker

    triton_as_on_a_gpu_host(gpu_worker)

    gpu_worker.Worker.init_device = cpu_init_device
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_general_plugins, load_plugins_by_group
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    if mode not in ("off", "loop", "extensible-late"):  # turned on here, after the seam above: only vLLM's loader acts
        os.environ["MEMWATCH"] = "1"
    environment = dict(os.environ)
    facts["general_plugins"] = sorted(load_plugins_by_group(DEFAULT_PLUGINS_GROUP))
    load_general_plugins()
    from vllm.v1.core.sched.scheduler import Scheduler

    factories = load_stat_logger_plugin_factories()
    facts["stat_logger_factories"] = [repr(factory) for factory in factories]
    facts["environment_changed"] = sorted(name for name in set(os.environ) | set(environment)
                                          if os.environ.get(name) != environment.get(name))
    facts["meta_path"] = [type(finder).__module__ for finder in sys.meta_path]
    facts["worker_wrapped"] = _wrapped(gpu_worker.Worker)
    facts["scheduler_wrapped"] = _wrapped(Scheduler)
    if mode in ("off", "on"):  # after the environment is compared: AsyncLLM sets variables of vLLM's own
        facts["async_llm_log_stats"] = _async_llm_log_stats(make_config(model, 0, dp=1, tp=1))
    if mode == "on":
        facts["engines"] = [_engine(model, dp_rank) for dp_rank in (0, 1)]
    elif mode == "workload":
        facts.update(_workload(model, int(sys.argv[3])))
    elif mode == "engine-core":
        facts.update(_engine_core_alone(model))
    elif mode == "dense-dp":
        facts["engines"] = _dense_data_parallel(model)
    elif mode == "override":
        facts.update(_blocks_override(model, int(sys.argv[3])))
    elif mode in ("extensible", "extensible-late"):
        facts.update(_extensible(model, [int(blocks) for blocks in sys.argv[3].split(",")],
                                 late=mode == "extensible-late"))
    elif mode == "loop":
        _loop(model, Path(sys.argv[3]))
        return
    print(json.dumps(facts))


def _engine(model: str, dp_rank: int) -> dict[str, Any]:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu_worker import Worker

    config = make_config(model, dp_rank, spec_tokens=2 if dp_rank == 1 else 0)
    workers = [Worker(vllm_config=config, local_rank=tp, rank=tp, distributed_init_method="tcp://127.0.0.1:1",
                      is_driver_worker=tp == 0) for tp in range(2)]
    for worker in workers:
        worker.init_device()
    kv_cache_configs = plan_kv(config, [(4 * MiB if dp_rank == 0 else 3 * MiB // 2)] * len(workers))
    for worker, kv_cache_config in zip(workers, kv_cache_configs, strict=True):
        worker.initialize_from_config(kv_cache_config)
    # Engine 0 runs as offline LLM(...) does (no stats); engine 1 as a served engine (SchedulerStats each step).
    scheduler = Scheduler(config, kv_cache_configs[0], StructuredOutputManager(config), block_size=16,
                          log_stats=dp_rank == 1)
    if dp_rank == 0:
        steps = serve(scheduler, {"a": 100}, max_tokens=3, drafts=0)
    else:
        steps = serve(scheduler, {name: 300 for name in "abc"}, max_tokens=180, drafts=2)
    facts = {"num_blocks": kv_cache_configs[0].num_blocks, "steps": steps,
             "kv_cache_tensors": [tensor.size for tensor in kv_cache_configs[0].kv_cache_tensors],
             "allocated_bytes": [worker.model_runner.allocated_bytes for worker in workers]}
    for worker in workers:
        worker.shutdown()
    scheduler.shutdown()
    return facts


WORKLOAD_KV_BYTES = 8 * MiB
WORKLOAD_PROMPTS = {f"r{i}": 40 + 10 * i for i in range(8)}


def _one_gpu_engine(model: str, block_size: int) -> tuple[Any, Any, Any]:
    """One engine on one GPU (TP 1, DP 1) of full-attention layers: its worker, KV config and scheduler."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu_worker import Worker

    config = make_config(model, 0, dp=1, tp=1, block_size=block_size)
    worker = Worker(vllm_config=config, local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1",
                    is_driver_worker=True)
    worker.init_device()
    # vLLM's own process groups, on gloo over a free local port: Worker.execute_model asks them its PP rank.
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(config):
        init_worker_distributed_environment(config, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
    [kv_cache_config] = plan_kv(config, [WORKLOAD_KV_BYTES], hybrid=False)
    worker.initialize_from_config(kv_cache_config)
    scheduler = Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=block_size,
                          log_stats=False)
    return worker, kv_cache_config, scheduler


def _workload(model: str, block_size: int) -> dict[str, Any]:
    """Eight requests arriving one every four steps, 20 tokens each, served by one GPU's engine."""
    worker, kv_cache_config, scheduler = _one_gpu_engine(model, block_size)
    steps = serve(scheduler, WORKLOAD_PROMPTS, max_tokens=20, drafts=0, stagger=4, worker=worker)
    worker.shutdown()
    scheduler.shutdown()
    return {"num_blocks": kv_cache_config.num_blocks, "prompts": WORKLOAD_PROMPTS, "steps": steps}


def _engine_core_alone(model: str) -> dict[str, Any]:
    """An engine core with TP 2, whose workers run in processes of their own (vLLM's ``MultiprocExecutor``):
    they start and allocate their KV cache there; this process holds the scheduler only, and serves the
    workload of :func:`_workload`."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = make_config(model, 0, dp=1, tp=2, block_size=16)
    kv_cache_configs = plan_kv(config, [WORKLOAD_KV_BYTES] * 2, hybrid=False)
    context = multiprocessing.get_context("fork")  # vLLM's plugin already loaded: the children's Worker is patched
    workers = [context.Process(target=_remote_worker, args=(config, tp, kv_cache_configs[tp])) for tp in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        if worker.exitcode != 0:
            raise RuntimeError(f"worker process exited with {worker.exitcode}")
    scheduler = Scheduler(config, kv_cache_configs[0], StructuredOutputManager(config), block_size=16,
                          log_stats=False)
    steps = serve(scheduler, WORKLOAD_PROMPTS, max_tokens=20, drafts=0, stagger=4)
    scheduler.shutdown()
    return {"prompts": WORKLOAD_PROMPTS, "num_blocks": kv_cache_configs[0].num_blocks, "steps": steps}


def _remote_worker(config: Any, tp_rank: int, kv_cache_config: Any) -> None:
    """One of the engine core's GPU workers in a process of its own: started and given its KV cache."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = Worker(vllm_config=config, local_rank=tp_rank, rank=tp_rank,
                    distributed_init_method="tcp://127.0.0.1:1", is_driver_worker=tp_rank == 0)
    worker.init_device()
    worker.initialize_from_config(kv_cache_config)
    worker.shutdown()


DENSE_KV_BYTES = (4 * MiB, 2 * MiB)
DENSE_PROMPTS = ({"a": 100, "b": 60}, {"c": 200})


def _dense_data_parallel(model: str) -> list[dict[str, Any]]:
    """Two engine cores of a dense model (the front end's DP 2 × TP 2), each in a process of its own, as
    vLLM's ``CoreEngineProcManager`` starts them: each runs vLLM's ``run_engine_core``, which reconfigures
    the engine as an independent DP rank (``data_parallel_size`` 1, ``data_parallel_rank`` 0) before it
    builds the engine core. Engine ``i`` gets ``DENSE_KV_BYTES[i]`` per worker and serves ``DENSE_PROMPTS[i]``."""
    context = multiprocessing.get_context("fork")  # vLLM's plugin already loaded: the children's classes are patched
    results = context.Queue()
    engines = [context.Process(target=_dense_engine_process, args=(model, dp_rank, results)) for dp_rank in range(2)]
    for engine in engines:
        engine.start()
    facts = [results.get(timeout=120) for _ in engines]
    for engine in engines:
        engine.join(timeout=60)
        if engine.exitcode != 0:
            raise RuntimeError(f"engine core process exited with {engine.exitcode}")
    return sorted(facts, key=lambda engine: engine["dp_index"])


def _dense_engine_process(model: str, dp_rank: int, results: Any) -> None:
    """One engine core process: vLLM's ``run_engine_core`` with the engine core it builds replaced (below)."""
    from vllm.v1.engine import core

    run_engine_core = core.EngineCoreProc.run_engine_core
    core.EngineCoreProc = _InProcessEngineCore
    config = make_config(model, 0, dp=2, tp=2)  # what the front end hands every engine core: DP 2, rank 0
    run_engine_core(vllm_config=config, log_stats=False, dp_rank=dp_rank, local_dp_rank=dp_rank)
    results.put(_InProcessEngineCore.finished)


class _InProcessEngineCore:
    """Stands where ``run_engine_core`` builds ``EngineCoreProc`` (its ZMQ handshake and executor): the engine's
    two workers in this process, their KV cache planned by vLLM's planner, and the engine core's scheduler.
    ``run_busy_loop`` serves the engine's prompts; ``shutdown`` is what ``run_engine_core`` calls at the end."""

    finished: ClassVar[dict[str, Any]] = {}
    """What the engine saw, once ``shutdown`` ran."""

    def __init__(self, vllm_config: Any, log_stats: bool, engine_index: int = 0) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.gpu_worker import Worker

        parallel = vllm_config.parallel_config
        self.index = engine_index
        self.facts = {"dp_index": parallel.data_parallel_index, "data_parallel_size": parallel.data_parallel_size,
                      "data_parallel_rank": parallel.data_parallel_rank}
        self.workers = [Worker(vllm_config=vllm_config, local_rank=tp, rank=tp,
                               distributed_init_method="tcp://127.0.0.1:1", is_driver_worker=tp == 0)
                        for tp in range(2)]
        for worker in self.workers:
            worker.init_device()
        self.kv_cache_configs = plan_kv(vllm_config, [DENSE_KV_BYTES[engine_index]] * 2, hybrid=False)
        for worker, kv_cache_config in zip(self.workers, self.kv_cache_configs, strict=True):
            worker.initialize_from_config(kv_cache_config)
        self.scheduler = Scheduler(vllm_config, self.kv_cache_configs[0], StructuredOutputManager(vllm_config),
                                   block_size=16, log_stats=log_stats)

    def run_busy_loop(self) -> None:
        steps = serve(self.scheduler, DENSE_PROMPTS[self.index], max_tokens=4, drafts=0)
        self.facts.update(num_blocks=self.kv_cache_configs[0].num_blocks, steps=steps)

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()
        _InProcessEngineCore.finished = self.facts


OVERRIDE_KV_BYTES = 8 * MiB
EXTENSIBLE_WEIGHTS, EXTENSIBLE_ACTIVATION = 7 * MiB + 512 * 1024, 3 * MiB


def _blocks_override(model: str, blocks: int) -> dict[str, Any]:
    """One engine, TP 2, started with ``kv_cache_memory_bytes`` 8 MiB and ``num_gpu_blocks_override``: vLLM's own
    ``determine_available_memory`` returns the 8 MiB (after the profiling forward), its planner plans on the
    override, and the scheduler serves one prompt on the blocks it got."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu_worker import Worker

    config = make_config(model, 0, dp=1, tp=2, kv_cache_memory_bytes=OVERRIDE_KV_BYTES, num_gpu_blocks_override=blocks)
    workers = [Worker(vllm_config=config, local_rank=tp, rank=tp, distributed_init_method="tcp://127.0.0.1:1",
                      is_driver_worker=tp == 0) for tp in range(2)]
    for worker in workers:
        worker.init_device()
    available = [worker.determine_available_memory() for worker in workers]
    kv_cache_configs = plan_kv(config, available, hybrid=False)
    for worker, kv_cache_config in zip(workers, kv_cache_configs, strict=True):
        worker.initialize_from_config(kv_cache_config)
    scheduler = Scheduler(config, kv_cache_configs[0], StructuredOutputManager(config), block_size=16,
                          log_stats=False)
    steps = serve(scheduler, {"a": 100}, max_tokens=3, drafts=0)
    facts = {"available": available, "num_blocks": [c.num_blocks for c in kv_cache_configs], "steps": steps,
             "kv_cache_tensors": [tensor.size for tensor in kv_cache_configs[0].kv_cache_tensors]}
    for worker in workers:
        worker.shutdown()
    scheduler.shutdown()
    return facts


def _extensible(model: str, measured: list[int], late: bool = False) -> dict[str, Any]:
    """One engine, TP 2, with vLLM 0.34's extensible KV cache (its default on CUDA): the planner reserves the
    capacity of the 8 MiB each worker offers, ``initialize_from_config`` reserves it, each worker measures
    ``measured[rank]`` blocks after warmup (``CompilationTimes.num_kv_blocks``), vLLM's own
    ``finalize_extensible_kv_cache`` settles on the smallest and shrinks the configs, and every worker's
    ``extend_kv_cache`` commits that count; the scheduler then serves one prompt on it. Before the count is
    measured each worker's allocator holds the weights (7.5 MiB) and has run a warmup forward (3 MiB), as
    ``vllm_seams.weights_and_warmup`` describes. ``late``: started with
    memwatch off, and attached once the count is committed, as ``attach --inject`` attaches (its in-process
    half, :func:`memwatch_engine.adapters.vllm.late.attach`)."""
    from vllm.v1.core.kv_cache_planning import finalize_extensible_kv_cache
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.worker_base import CompilationTimes

    cpu_extensible_kv_cache(gpu_worker)
    config = make_config(model, 0, dp=1, tp=2)
    config.cache_config.enable_extensible_kv_cache = True  # what vLLM settles on for a CUDA device with VMM
    workers = [gpu_worker.Worker(vllm_config=config, local_rank=tp, rank=tp,
                                 distributed_init_method="tcp://127.0.0.1:1", is_driver_worker=tp == 0)
               for tp in range(2)]
    for worker in workers:
        worker.init_device()
    kv_cache_configs = plan_kv(config, [OVERRIDE_KV_BYTES] * 2, hybrid=False)
    reserved = kv_cache_configs[0].num_blocks
    for worker, kv_cache_config in zip(workers, kv_cache_configs, strict=True):
        worker.initialize_from_config(kv_cache_config)
    for worker in workers:
        weights_and_warmup(worker, EXTENSIBLE_WEIGHTS, EXTENSIBLE_ACTIVATION)
    scheduler_config = copy.deepcopy(kv_cache_configs[0])
    times = [CompilationTimes(0.0, 0.0, num_kv_blocks=blocks) for blocks in measured]
    num_blocks = finalize_extensible_kv_cache(config, kv_cache_configs, scheduler_config, times)
    for worker in workers:
        worker.extend_kv_cache(num_blocks)
    if late:
        from memwatch_engine.adapters.vllm import late as vllm_late

        vllm_late.attach(run_id=os.environ["MEMWATCH_RUN_ID"], runtime_dir=os.environ["MEMWATCH_RUNTIME_DIR"])
    scheduler = Scheduler(config, scheduler_config, StructuredOutputManager(config), block_size=16, log_stats=False)
    steps = serve(scheduler, {"a": 100}, max_tokens=3, drafts=0)
    facts = {"reserved": reserved, "num_blocks": num_blocks, "steps": steps,
             "committed_bytes": [worker.model_runner.allocated_bytes for worker in workers],
             "scheduler_blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks}
    for worker in workers:
        worker.shutdown()
    scheduler.shutdown()
    return facts


def _loop(model: str, stop: Path) -> None:
    """A serving loop started without memwatch: rounds of three requests until ``stop`` exists.

    Prints ``ready`` after the first round, then, at the end, what the rounds scheduled (every round the
    same), the KV block count, whether vLLM's classes have their own methods again, and the threads.
    """
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_worker import Worker

    originals = [dict(vars(Worker)), dict(vars(Scheduler))]
    worker, kv_cache_config, scheduler = _one_gpu_engine(model, 16)
    rounds: list[tuple[tuple[int, int], ...]] = []
    while len(rounds) < 3 or not stop.exists():
        prompts = {f"q{len(rounds)}-{i}": 60 + 20 * i for i in range(3)}
        steps = serve(scheduler, prompts, max_tokens=8, drafts=0, worker=worker)
        rounds.append(tuple((step["num_seqs"], step["num_tokens"]) for step in steps))
        if len(rounds) == 1:
            print("ready", flush=True)
        time.sleep(0.05)
    print("blocks", kv_cache_config.num_blocks)
    print("rounds", sorted(set(rounds)))
    print("originals", [dict(vars(Worker)), dict(vars(Scheduler))] == originals)
    print("threads", sorted(thread.name for thread in threading.enumerate()), flush=True)


if __name__ == "__main__":
    main()
