"""Drive the released SGLang 0.5.23 (installed by ``make engines``) with memwatch, on CPU.

Run as ``python sglang_driver.py MODE MODEL_DIR``; prints one JSON line of what it saw. SGLang's own
code runs throughout: ``ServerArgs``, ``runtime_context.publish`` (a scheduler process's placement),
``ModelConfig``, ``ModelRunner.__init__``/``initialize``/``alloc_memory_pool``, the
``KVCacheConfigurator`` that profiles the free memory and the ``DefaultPoolConfigurator`` that turns
it into ``max_total_num_tokens``, the real token pools and allocator (their tensors on the CPU).
What stands in for the GPU is in ``sglang_seams.py``. The seams are applied before memwatch activates
(``memwatch_engine.activate.autoload`` with ``MEMWATCH=1``, what the ``.pth`` line runs), so memwatch
wraps the methods SGLang's process runs.

The token pool is SGLang's unpaged one (``page_size`` 1) when the scheduler runs: the paged allocator
runs a Triton kernel; the radix tree is SGLang's Python one (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``):
its Rust one makes its tensors on the device from native code.

Modes: ``off`` sizes one rank with memwatch off; ``on`` the same with memwatch on; ``tp2`` sizes two
tensor-parallel ranks in processes of their own (rank 1's device has other memory on it, so SGLang's
minimum over the ranks decides both pools); ``dp2`` two data-parallel replicas of TP 2 on four GPUs;
``dp-attention`` TP 2 with data-parallel attention (:data:`LAYOUTS`); ``serve`` (``serve-off``: memwatch
off) runs a real ``Scheduler`` through four requests that retract (:func:`_serve`); ``oom`` sizes one
rank and then asks the device for more than it has left; ``late`` injects memwatch into a scheduler that
started without it (:func:`_late`); ``serve-long`` serves :data:`LONG_PROMPTS` (hundreds of steps, with
retractions); ``request-cap`` sizes one rank with :data:`REQUEST_CAP` (a hybrid sliding-window model's
request-capped pools); ``late-size`` injects memwatch into a rank that sized its pool without it;
``post-capture`` builds the scheduler with ``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1`` (the
test sets it; ``post_capture_seams`` in ``sglang_seams.py``), so SGLang sizes its pool again after graph
capture, and serves one round.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

from fake_device import load_fake_cuda
from sglang_seams import cuda_seams, forward_seam, free_port, post_capture_seams, runner_seams

MiB = 1 << 20
OOM_REQUEST_BYTES = 512 * MiB
WRAPPED = "__memwatch_wrapped__"


def _server_args(model: str, tp: int, **overrides: Any) -> Any:
    from sglang.srt.server_args import ServerArgs

    settings = {"mem_fraction_static": 0.8, "page_size": 16, **overrides}
    return ServerArgs(model_path=model, device="cuda", tp_size=tp, skip_tokenizer_init=True, **settings)


REQUEST_CAP = {"disable_radix_cache": True, "max_running_requests": 8, "chunked_prefill_size": 256,
               "disable_overlap_schedule": True}
_RUNNERS: list[Any] = []  # every model runner sized here, alive for an injected memwatch to find


def _size_rank(model: str, tp: int, tp_rank: int, dp_rank: int | None = None, gpu_id: int | None = None,
               **overrides: Any) -> dict[str, Any]:
    """One scheduler process's model runner, up to its KV pool, as ``run_scheduler_process`` places it."""
    import fake_cuda
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, publish

    args = _server_args(model, tp, **overrides)
    gpu_id = tp_rank if gpu_id is None else gpu_id
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank, dp_rank=dp_rank, gpu_id=gpu_id))
    fake_cuda._set_device(gpu_id)
    runner = ModelRunner(model_config=ModelConfig.from_server_args(args), mem_fraction_static=args.mem_fraction_static,
                         gpu_id=gpu_id, nccl_port=1, server_args=args)
    runner.alloc_memory_pool()
    _RUNNERS.append(runner)
    allocator = runner.token_to_kv_pool_allocator
    return {"max_total_num_tokens": runner.max_total_num_tokens, "available_size": allocator.available_size(),
            "pre_model_load_memory": runner.pre_model_load_memory, "page_size": runner.page_size,
            "mem_fraction_static": args.mem_fraction_static, "max_running_requests": runner.max_running_requests}


SERVE_PROMPTS = {f"r{i}": 50 for i in range(4)}
SERVE_MAX_NEW_TOKENS = 80
SERVE_MEM_FRACTION = 0.264


def _scheduler(model: str, ports: list[Any] | None = None) -> Any:
    """A real ``Scheduler`` (its model worker, pools, radix cache, policy) on one GPU, as
    ``run_scheduler_process`` builds it; its ``PortArgs`` are appended to ``ports`` when given."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import PortArgs

    args = _server_args(model, 1, disable_cuda_graph=True, disable_overlap_schedule=True, page_size=1,
                        attention_backend="torch_native", sampling_backend="pytorch", grammar_backend="none",
                        mem_fraction_static=SERVE_MEM_FRACTION)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    port_args = PortArgs.init_new(args)
    if ports is not None:
        ports.append(port_args)
    return Scheduler(args, port_args)


def _requests(prompts: dict[str, int], max_new_tokens: int) -> list[Any]:
    """The tokenizer manager's ``TokenizedGenerateReqInput`` for each prompt (token ids sharing no prefix)."""
    from array import array

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    requests = []
    for rid, length in prompts.items():
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        params.normalize(None)
        first = 1 + 100 * (sum(map(ord, rid)) % 9)
        requests.append(TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=array("q", range(first, first + length)), mm_inputs=None,
            input_embeds=None, token_type_ids=None, sampling_params=params, return_logprob=False,
            logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False))
    return requests


def _event_loop(scheduler: Any, port_args: Any, prompts: dict[str, int], max_new_tokens: int) -> list[dict[str, Any]]:
    """SGLang's own ``event_loop_normal`` until every request finished, the requests sent as the tokenizer
    manager sends them (a ZeroMQ PUSH socket bound on ``scheduler_input_ipc_name``, ``sock_send``).

    What stands in is the loop's end only: after ``on_idle`` with every request finished, ``gracefully_exit``.
    Per batch, read between ``run_batch`` and ``process_batch_result`` (an instance attribute over the method):
    SGLang's forward mode, requests, extend tokens, available and evictable tokens, and the requests
    retracted to make room for it (``metrics_reporter.num_retracted_reqs``, reset after each batch)."""
    import zmq
    from sglang.srt.managers.io_struct import sock_send
    from sglang.srt.utils.network import get_zmq_socket

    steps: list[dict[str, Any]] = []
    finished: set[str] = set()
    process_batch_result, on_idle = scheduler.process_batch_result, scheduler.on_idle

    def observe(batch: Any, result: Any) -> Any:
        allocator = scheduler.token_to_kv_pool_allocator
        steps.append({"mode": batch.forward_mode.name, "num_seqs": batch.batch_size(),
                      "extend_tokens": batch.extend_num_tokens, "available": allocator.available_size(),
                      "evictable": scheduler.tree_cache.evictable_size(),
                      "retracted": scheduler.metrics_reporter.num_retracted_reqs})
        scheduler.metrics_reporter.num_retracted_reqs = 0
        if len(steps) > 5000:
            raise RuntimeError("the scheduler ran 5,000 batches without finishing")
        outcome = process_batch_result(batch, result)
        finished.update(req.rid for req in batch.reqs if req.finished())
        return outcome

    def idle() -> None:
        on_idle()
        if len(finished) == len(prompts):
            scheduler.gracefully_exit = True

    scheduler.process_batch_result, scheduler.on_idle = observe, idle
    scheduler.metrics_reporter.num_retracted_reqs = 0
    context = zmq.Context()
    sender = get_zmq_socket(context, zmq.PUSH, port_args.scheduler_input_ipc_name, True)
    try:
        for request in _requests(prompts, max_new_tokens):
            sock_send(sender, request)
        scheduler.event_loop_normal()
    finally:
        sender.close(linger=0)
        context.term()
    return steps


def _serve_round(scheduler: Any, prompts: dict[str, int], max_new_tokens: int) -> list[dict[str, Any]]:
    """The body of ``event_loop_normal`` until every request finished, with requests handed to
    ``handle_generate_request`` as the tokenizer manager's ``TokenizedGenerateReqInput``.

    Returns, per ``run_batch``, what SGLang itself says: the batch's forward mode, requests and extend tokens,
    the pool's available and evictable tokens right after the batch ran, and the requests retracted to
    make room for it (``metrics_reporter.num_retracted_reqs``)."""
    from array import array

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    for rid, length in prompts.items():
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        params.normalize(None)
        first = 1 + 100 * (sum(map(ord, rid)) % 9)  # prompts of one round share no prefix
        scheduler.handle_generate_request(TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=array("q", range(first, first + length)), mm_inputs=None,
            input_embeds=None, token_type_ids=None, sampling_params=params, return_logprob=False,
            logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False))
    steps: list[dict[str, Any]] = []
    for _ in range(2000):
        scheduler.metrics_reporter.num_retracted_reqs = 0
        plan = scheduler.get_next_batch_to_run(running_batch=scheduler.running_batch,
                                               last_batch=scheduler.last_batch)
        scheduler.running_batch = plan.running_batch
        batch = plan.batch_to_run
        if batch:
            result = scheduler.run_batch(batch)
            allocator = scheduler.token_to_kv_pool_allocator
            steps.append({"mode": batch.forward_mode.name, "num_seqs": batch.batch_size(),
                          "extend_tokens": batch.extend_num_tokens, "available": allocator.available_size(),
                          "evictable": scheduler.tree_cache.evictable_size(),
                          "retracted": scheduler.metrics_reporter.num_retracted_reqs})
            scheduler.process_batch_result(batch, result)
        scheduler.last_batch = batch
        if not batch and not scheduler.waiting_queue and scheduler.running_batch.is_empty():
            break
    return steps


def _serve(model: str) -> dict[str, Any]:
    """Four requests that cannot all keep their KV tokens (on a small device at ``mem_fraction_static`` 0.264
    SGLang sizes a pool of a few hundred tokens)."""
    scheduler = _scheduler(model)
    steps = _serve_round(scheduler, SERVE_PROMPTS, SERVE_MAX_NEW_TOKENS)
    return {"max_total_num_tokens": scheduler.max_total_num_tokens, "steps": steps,
            "prompts": SERVE_PROMPTS, "max_new_tokens": SERVE_MAX_NEW_TOKENS}


LONG_PROMPTS = {f"q{i}": 30 + 5 * i for i in range(12)}
LONG_MAX_NEW_TOKENS = 60


def _serve_long(model: str) -> dict[str, Any]:
    """Twelve requests of 30 to 85 prompt tokens, 60 output tokens each, on a pool of a few hundred tokens.

    memwatch's ``kv_evictable`` events come at most once a second; here every change is recorded, so that each
    can be compared with SGLang's count at its step."""
    from memwatch_engine.adapters.sglang import scheduler as hooks

    hooks.EVICTABLE_INTERVAL_NS = 0
    ports: list[Any] = []
    scheduler = _scheduler(model, ports)
    steps = _event_loop(scheduler, ports[0], LONG_PROMPTS, LONG_MAX_NEW_TOKENS)
    return {"max_total_num_tokens": scheduler.max_total_num_tokens, "steps": steps, "prompts": LONG_PROMPTS,
            "max_new_tokens": LONG_MAX_NEW_TOKENS}


def _post_capture(model: str) -> dict[str, Any]:
    """The scheduler sizes its pool, captures (the seam's graph pool), sizes it again, then serves a round."""
    scheduler = _scheduler(model)
    runner = scheduler.tp_worker.model_runner
    steps = _serve_round(scheduler, {"p0": 40, "p1": 60}, 8)
    return {"max_total_num_tokens": scheduler.max_total_num_tokens, "runner_tokens": runner.max_total_num_tokens,
            "allocator_size": scheduler.token_to_kv_pool_allocator.size,
            "backed_bytes": runner.token_to_kv_pool.post_capture_backed_bytes,
            "post_capture_active": runner.token_to_kv_pool.post_capture_active, "steps": steps}


def _late(model: str, runtime_dir: str) -> dict[str, Any]:
    """A scheduler started with memwatch off serves a round; memwatch is injected (the request
    ``attach --inject`` makes the target run, handed to ``memwatch_engine.inject.handle``), a second round
    runs, memwatch detaches, a third round runs."""
    import tempfile

    from sglang.srt.managers.scheduler import Scheduler

    originals = dict(vars(Scheduler))
    scheduler = _scheduler(model)
    rounds = [_serve_round(scheduler, {"a0": 40, "a1": 60}, 8)]
    status = Path(tempfile.mkdtemp()) / "status.json"
    from memwatch_engine import inject

    inject.handle(json.dumps({"run_id": os.environ["MEMWATCH_RUN_ID"], "runtime_dir": runtime_dir,
                              "status": str(status)}))
    attached = json.loads(status.read_text())
    rounds.append(_serve_round(scheduler, {"b0": 30, "b1": 50, "b2": 70}, 8))
    inject.handle(json.dumps({"action": "detach", "status": str(status)}))
    detached = json.loads(status.read_text())
    rounds.append(_serve_round(scheduler, {"c0": 20}, 4))
    return {"attached": attached, "detached": detached, "rounds": rounds,
            "max_total_num_tokens": scheduler.max_total_num_tokens, "originals": dict(vars(Scheduler)) == originals}


def _activate() -> None:
    os.environ["MEMWATCH"] = "1"
    from memwatch_engine.activate import autoload

    autoload()


def _rank_process(model: str, tp_rank: int, dp_rank: int | None, gpu_id: int, port: int, overrides: dict[str, Any],
                  queue: Any) -> None:
    """One scheduler process of a TP group (its gloo group on ``port``) as the launcher places it."""
    import torch

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=tp_rank, world_size=2)
    queue.put((gpu_id, _size_rank(model, 2, tp_rank, dp_rank, gpu_id, **overrides)))
    torch.distributed.barrier()
    from memwatch_engine.adapters.sglang import runner

    runner.finish()  # a multiprocessing child exits without running atexit


# (tp_rank, dp_rank the launcher passes, GPU, TP group) of each scheduler process, and the settings.
LAYOUTS: dict[str, tuple[list[tuple[int, int | None, int, int]], dict[str, Any]]] = {
    "tp2": ([(0, None, 0, 0), (1, None, 1, 0)], {}),
    # Two replicas of TP 2 (run_data_parallel_controller_process passes each replica's dp_rank).
    "dp2": ([(0, 0, 0, 0), (1, 0, 1, 0), (0, 1, 2, 1), (1, 1, 3, 1)], {"dp_size": 2}),
    # DP attention: one TP group of 2 whose attention runs data parallel (the controller passes the attention
    # DP rank as dp_rank); SGLang resolves it to attn_dp_size 2, dp_size 1.
    "dp-attention": ([(0, 0, 0, 0), (1, 1, 1, 0)], {"dp_size": 2, "enable_dp_attention": True}),
}


def _ranks(model: str, mode: str) -> list[dict[str, Any]]:
    """Every scheduler process of ``LAYOUTS[mode]`` in a process of its own, up to its KV pool."""
    layout, overrides = LAYOUTS[mode]
    ports = {group: free_port() for *_, group in layout}
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=_rank_process,
                                 args=(model, tp_rank, dp_rank, gpu, ports[group], overrides, queue))
                 for tp_rank, dp_rank, gpu, group in layout]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=240) for _ in processes)
    for process in processes:
        process.join(timeout=120)
        if process.exitcode != 0:
            raise RuntimeError(f"rank process exited with {process.exitcode}")
    return [results[gpu] for gpu in sorted(results)]


def main() -> None:
    mode, model = sys.argv[1], sys.argv[2]
    load_fake_cuda()
    cuda_seams()
    runner_seams()
    forward_seam()
    environment = dict(os.environ)
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner import ModelRunner

    if mode == "post-capture":
        post_capture_seams()
    if mode in ("on", "oom", "serve", "serve-long", "post-capture", "request-cap", *LAYOUTS):
        _activate()
    facts: dict[str, Any] = {
        "environment_changed": sorted(name for name in set(os.environ) | set(environment)
                                      if os.environ.get(name) != environment.get(name)),
        "meta_path": [type(finder).__module__ for finder in sys.meta_path],
        "runner_wrapped": sorted(n for n, v in vars(ModelRunner).items() if getattr(v, WRAPPED, False)),
        "configurator_wrapped": sorted(n for n, v in vars(KVCacheConfigurator).items()
                                       if getattr(v, WRAPPED, False)),
    }
    if mode in ("off", "on"):
        facts["ranks"] = [_size_rank(model, 1, 0)]
    elif mode == "oom":  # a rank that sized its pool, then a request for more than the device has left
        import torch

        facts["ranks"] = [_size_rank(model, 1, 0)]
        try:
            torch.empty(OOM_REQUEST_BYTES, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            facts["error"] = type(exc).__name__
    elif mode in ("serve", "serve-off"):
        facts.update(_serve(model))
    elif mode == "serve-long":
        facts.update(_serve_long(model))
    elif mode == "post-capture":
        facts.update(_post_capture(model))
    elif mode == "request-cap":  # radix cache off, 8 requests at most: SGLang sizes the sliding-window pool for them
        facts["ranks"] = [_size_rank(model, 1, 0, **REQUEST_CAP)]
    elif mode == "late-size":  # memwatch injected into a rank that sized its pool without it
        facts["ranks"] = [_size_rank(model, 1, 0)]
        from memwatch_engine.adapters.sglang import late

        [monitor] = late.attach(run_id=os.environ["MEMWATCH_RUN_ID"], runtime_dir=os.environ["MEMWATCH_RUNTIME_DIR"])
        monitor.close("detached")
    elif mode == "late":
        facts.update(_late(model, os.environ["MEMWATCH_RUNTIME_DIR"]))
    elif mode in LAYOUTS:
        facts["ranks"] = _ranks(model, mode)
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
