"""vLLM's engine-core scheduler wrapped in process: one sample per scheduled step with KV blocks and load, the
preemptions, and the workload's request events, into real rings.

The scheduler is vLLM 0.34's in short (``vllm/v1/core/sched/scheduler.py``, ``block_pool.py``, ``request.py``):
``Scheduler(vllm_config, kv_cache_config, structured_output_manager, block_size, …)`` whose block pool keeps one
null block out of ``num_gpu_blocks``; ``schedule()`` gives each waiting request its prompt's blocks and each
running one a decode token, and returns a ``SchedulerOutput`` with the requests preempted since the last step;
``add_request`` takes a new id in (a streaming session's later chunk is the same id), ``_free_request`` lets a
finished one go; ``get_request_counts()`` is ``(running, waiting)``; a request's ``num_tokens`` is its prompt and
the output so far. vLLM 0.33 has no ``get_request_counts``: its lists are counted.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from test_vllm_gpu_worker import _config, _ring

from memwatch_engine.adapters import hooks
from memwatch_engine.adapters.vllm import scheduler as vllm_scheduler
from memwatch_engine.monitor import Monitor
from memwatch_engine.probes.base import UNKNOWN, Probe
from memwatch_engine.ring_format import STEP_KIND_CODES, sample_load
from memwatch_engine.ring_reader import RingReader

BLOCKS = 1001  # 1,000 blocks and the null block


class Request:
    def __init__(self, request_id: str, prompt: int, max_tokens: int) -> None:
        self.request_id, self.num_prompt_tokens, self.max_tokens, self.output = request_id, prompt, max_tokens, 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.output

    @property
    def num_output_tokens(self) -> int:
        return self.output


class Scheduler:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, structured_output_manager: Any, block_size: int,
                 log_stats: bool = False) -> None:
        self.vllm_config, self.block_size, self.log_stats = vllm_config, block_size, log_stats
        self.throttled: list[bool] = []
        self.held = 0
        pool = SimpleNamespace(num_gpu_blocks=kv_cache_config.num_blocks,
                               get_num_free_blocks=lambda: kv_cache_config.num_blocks - 1 - self.held)
        self.kv_cache_manager = SimpleNamespace(block_pool=pool)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.kv_holding_waiting: list[Request] = []  # 0.34: waiting, and holding KV blocks
        self.preempted: set[str] = set()
        self.down = False
        self.priorities: list[int] = []
        self.delayed: list[bool] = []

    def add_request(self, request: Request, priority: int = 0) -> None:
        self.priorities.append(priority)  # an argument a later vLLM might add
        if request.request_id not in self.requests:
            self.requests[request.request_id] = request
            self.waiting.append(request)

    def schedule(self, throttle_prefills: bool = False) -> Any:
        self.throttled.append(throttle_prefills)
        new, cached = list(self.waiting), list(self.running)
        self.running, self.waiting = cached + new, []
        for request in cached:
            request.output += 1
        self.held = sum(math.ceil(r.num_tokens / self.block_size) for r in self.running)
        scheduled = {r.request_id: r.num_prompt_tokens for r in new} | {r.request_id: 1 for r in cached}
        output = SimpleNamespace(
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id) for r in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r in cached],
                                                  num_output_tokens=[r.output for r in cached]),
            scheduled_spec_decode_tokens={}, preempted_req_ids=self.preempted)
        self.preempted = set()
        return output

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting) + len(self.kv_holding_waiting)

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> tuple[Any, Any]:
        self.running.remove(request)
        del self.requests[request.request_id]
        self.delayed.append(delay_free_blocks)
        return None, {"request_id": request.request_id}  # the KV transfer parameters

    def shutdown(self) -> None:
        self.down = True


@pytest.fixture
def runtime(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    yield runtime_dir
    vllm_scheduler._guard.active = True
    vllm_scheduler.set_lead(None)


def _module(cls: type = Scheduler, requests: bool = True) -> ModuleType:
    module = ModuleType(vllm_scheduler.SCHEDULER_MODULE)
    names = ("__init__", "schedule", "shutdown", "get_request_counts", *(vllm_scheduler.REQUEST_METHODS * requests))
    module.Scheduler = type("Scheduler", (cls,), {name: getattr(cls, name) for name in names})
    vllm_scheduler.patch_scheduler(module)
    return module


def _scheduler(module: ModuleType, blocks: int = BLOCKS, **parallel: Any) -> Any:
    config = _config(tp=2)
    vars(config.parallel_config).update(parallel)
    return module.Scheduler(config, SimpleNamespace(num_blocks=blocks), None, 16, log_stats=True)


def _loads(runtime_dir: Path, rank: int) -> list[tuple[int, int, int] | None]:
    """Each step's load as its sample carries it: requests running and waiting, KV blocks still needed."""
    [path] = runtime_dir.glob(f"*-r{rank}.ring")
    reader = RingReader(path)
    drained = reader.drain(0)
    reader.close()
    first = int.from_bytes(drained.slots[:8], "little")
    return [sample_load(drained.slots, sample[0] - first) for sample in drained.samples if sample[15] >= 0]


def _serve(scheduler: Any) -> list[Request]:
    """Two requests: a (40 prompt tokens, 10 to generate) and b (100, 30), two steps; b is then preempted."""
    a, b = Request("a", 40, 10), Request("b", 100, 30)
    scheduler.add_request(a)
    scheduler.add_request(b)
    scheduler.add_request(Request("b", 20, 30))  # a streaming session's next chunk: the same request
    scheduler.schedule(True)
    scheduler.preempted = {"b"}
    scheduler.schedule(throttle_prefills=True)
    assert scheduler.throttled == [True, True] and scheduler.log_stats  # what vLLM passed, passed on
    return [a, b]


def test_each_step_is_a_sample_with_its_kv_blocks_and_load_and_a_preemption_is_an_event(runtime: Path) -> None:
    scheduler = _scheduler(_module())
    a, b = _serve(scheduler)
    scheduler.add_request(Request("c", 8, 1), 3)
    scheduler.add_request(request=Request("d", 8, 1), priority=5)
    assert scheduler._free_request(a, True) == (None, {"request_id": "a"})
    assert scheduler._free_request(b, delay_free_blocks=True) == (None, {"request_id": "b"})
    assert (scheduler.priorities[-2:], scheduler.delayed) == ([3, 5], [True, True])  # what vLLM passed, passed on
    scheduler.shutdown()
    assert scheduler.down and vllm_scheduler.MONITOR_ATTRIBUTE not in vars(scheduler)
    header, events, samples = _ring(runtime, rank=2)  # one past the engine's two GPU ranks
    assert (header.rank, header.world_size, header.meta["probe"]) == (2, 2, "probe")  # no GPU: reads nothing
    assert (header.meta["engine"], header.meta["model"]) == ("vllm", "meta-llama/Llama-3.1-8B")
    assert header.meta["config"] == {"model_config": "meta-llama/Llama-3.1-8B"}
    named = dict(events)
    assert named["config"] == {
        "num_gpu_blocks": BLOCKS, "data_parallel_size": 1, "model_config": "meta-llama/Llama-3.1-8B",
        "dtype": "bfloat16", "kv_cache_dtype": "auto", "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
        "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": None, "block_size": 16,
        "max_num_batched_tokens": 8192, "max_num_seqs": 256, "max_model_len": 4096, "enforce_eager": False}
    assert named["rank_identity"] == {"role": "scheduler", "dp_rank": 0, "dp_size": 1, "tp_rank": 0, "pp_rank": 0}
    assert [data for kind, data in events if kind == "preemption"] == [{"count": 1}]
    assert [(kind, data) for kind, data in events if kind.startswith("request_")] == [
        ("request_arrived", {"request_id": "a", "prompt_tokens": 40, "max_tokens": 10}),
        ("request_arrived", {"request_id": "b", "prompt_tokens": 100, "max_tokens": 30}),
        ("request_arrived", {"request_id": "c", "prompt_tokens": 8, "max_tokens": 1}),
        ("request_arrived", {"request_id": "d", "prompt_tokens": 8, "max_tokens": 1}),
        ("request_finished", {"request_id": "a", "output_tokens": 1}),
        ("request_finished", {"request_id": "b", "output_tokens": 1})]
    steps = [(s["step_kind"], s["num_seqs"], s["num_tokens"], s["kv_used"], s["kv_total"]) for s in samples
             if s["num_seqs"] >= 0]
    # Step 1: a's 40 tokens in 3 blocks, b's 100 in 7. Step 2: a at 41 tokens (3 blocks), b at 101 (7).
    assert steps == [(STEP_KIND_CODES["prefill"], 2, 140, 10, 1000), (STEP_KIND_CODES["decode"], 2, 2, 10, 1000)]
    # Both running, none waiting; a needs 1 more block to reach 50 tokens, b 2 more to reach 130 (3 and 7 held).
    assert _loads(runtime, 2) == [(2, 0, 3), (2, 0, 3)]
    assert named["run_end"]["status"] == "ok"


def test_the_load_counts_running_and_waiting_and_the_blocks_still_needed(runtime: Path) -> None:
    scheduler = _scheduler(_module())
    a, b = _serve(scheduler)
    c = Request("c", 16, 4)
    scheduler.add_request(c)
    # a: 41 tokens in 3 blocks, 50 at the end in 4: 1 more; b: 101 in 7, 130 in 9: 2 more.
    assert vllm_scheduler.scheduler_load(scheduler) == (2, 1, 3)
    scheduler.block_size = 32  # a: 2 blocks now, 2 at the end; b: 4 now, 5 at the end
    assert vllm_scheduler.scheduler_load(scheduler) == (2, 1, 1)
    scheduler.kv_holding_waiting.append(Request("h", 8, 8))  # vLLM's own count has it, its waiting list not
    assert vllm_scheduler.scheduler_load(scheduler) == (2, 2, 1)
    scheduler.shutdown()
    older = SimpleNamespace(running=[a, b], waiting=[c, Request("d", 1, 1)], block_size=16)  # 0.33: no counts
    assert vllm_scheduler.scheduler_load(older) == (2, 2, 3)
    for broken in (SimpleNamespace(running=[a], waiting=[], block_size=0),
                   SimpleNamespace(running=[SimpleNamespace()], waiting=[], block_size=16),
                   SimpleNamespace(running=[Request("e", 5, None)], waiting=[], block_size=16)):
        assert vllm_scheduler.scheduler_load(broken) == (-1, -1, -1)


def test_a_block_pool_that_is_not_fresh_leaves_the_kv_columns_out(runtime: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "memwatch")

    class Used(Scheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            Scheduler.__init__(self, *args, **kwargs)
            self.held = 5  # five blocks taken before any request: a pool this adapter does not know

    scheduler = _scheduler(_module(Used))
    _serve(scheduler)
    scheduler.shutdown()
    assert [r.getMessage() for r in caplog.records if "block pool" in r.getMessage()] == [
        "memwatch: vLLM's new block pool has 995 of 1001 blocks free, not all but the null block (a version this "
        "adapter does not know): its steps are recorded without KV block usage"]
    samples = _ring(runtime, rank=2)[2]
    steps = [(s["num_seqs"], s["kv_used"], s["kv_total"]) for s in samples if s["num_seqs"] >= 0]
    assert steps == [(2, UNKNOWN, UNKNOWN)] * 2 and _loads(runtime, 2) == [(2, 0, 3)] * 2


def test_another_engines_scheduler_records_no_workload_and_engine_0s_goes_to_the_rank_0_worker(
        runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module()
    other = _scheduler(module, data_parallel_size=2, data_parallel_index=1, data_parallel_rank=1)
    _serve(other)
    other.shutdown()
    _, events, _ = _ring(runtime, rank=5)  # engine 1's scheduler: past 2 engines × 2 GPU ranks
    assert not [kind for kind, _ in events if kind.startswith("request_")]
    lead = Monitor(engine="vllm", rank=0, world_size=2, runtime_dir=tmp_path / "lead", spawn_sidecar=False,
                   probe=Probe())  # the rank-0 worker's ring; its readings do not matter here
    vllm_scheduler.set_lead(lead)
    first = _scheduler(module)
    _serve(first)
    first.shutdown()
    lead.close("ok")
    _, lead_events, _ = _ring(tmp_path / "lead")
    assert [data["request_id"] for kind, data in lead_events if kind == "request_arrived"] == ["a", "b"]
    assert not [kind for kind, _ in _ring(runtime, rank=2)[1] if kind.startswith("request_")]
    later = tmp_path / "later"
    later.mkdir(mode=0o700)
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(later))
    closed = _scheduler(module)  # the lead's ring closed: the scheduler's own takes the workload
    closed.add_request(Request("z", 8, 2))
    closed.shutdown()
    assert [data["request_id"] for kind, data in _ring(later, rank=2)[1] if kind == "request_arrived"] == ["z"]


def test_a_scheduler_without_request_methods_still_records_its_steps(runtime: Path) -> None:
    class Older(Scheduler):
        pass

    module = _module(Older, requests=False)
    assert not getattr(vars(module.Scheduler).get("add_request"), hooks.WRAPPED, False)
    scheduler = _scheduler(module)
    _serve(scheduler)
    scheduler.shutdown()
    _, events, samples = _ring(runtime, rank=2)
    assert len([s for s in samples if s["num_seqs"] >= 0]) == 2
    assert not [kind for kind, _ in events if kind.startswith("request_")]


def test_after_an_internal_fault_the_scheduler_runs_unrecorded(runtime: Path) -> None:
    module = _module()
    vllm_scheduler._guard.active = False
    unmonitored = _scheduler(module)  # built with the adapter off: no ring at all
    vllm_scheduler._guard.active = True
    unmonitored.shutdown()
    assert unmonitored.down and list(runtime.glob("*.ring")) == []
    scheduler = _scheduler(module)
    vllm_scheduler._guard.active = False
    _serve(scheduler)
    scheduler._free_request(scheduler.running[0])
    scheduler.shutdown()
    assert scheduler.down
    _, events, samples = _ring(runtime, rank=2)
    assert not [s for s in samples if s["num_seqs"] >= 0]
    assert not [kind for kind, _ in events if kind.startswith("request_") or kind in ("preemption", "run_end")]


def test_an_engine_fault_in_shutdown_is_the_engines_and_still_closes_the_ring(runtime: Path) -> None:
    class Failing(Scheduler):
        def shutdown(self) -> None:
            raise RuntimeError("engine core died")

    scheduler = _scheduler(_module(Failing))
    _serve(scheduler)
    with pytest.raises(RuntimeError, match="engine core died"):
        scheduler.shutdown()
    _, events, _ = _ring(runtime, rank=2)
    assert [kind for kind, _ in events][-1] == "run_end" and dict(events)["run_end"]["status"] == "ok"


def test_uninstall_puts_the_schedulers_methods_back(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = ModuleType(vllm_scheduler.SCHEDULER_MODULE)
    module.Scheduler = type("Scheduler", (Scheduler,), {name: getattr(Scheduler, name) for name in (
        "__init__", "schedule", "shutdown", *vllm_scheduler.REQUEST_METHODS)})
    originals = dict(vars(module.Scheduler))
    monkeypatch.setitem(sys.modules, vllm_scheduler.SCHEDULER_MODULE, module)
    vllm_scheduler.install()
    assert dict(vars(module.Scheduler)) != originals
    vllm_scheduler.set_lead(object())  # type: ignore[arg-type]
    vllm_scheduler.uninstall()
    assert dict(vars(module.Scheduler)) == originals and vllm_scheduler.lead() is None
