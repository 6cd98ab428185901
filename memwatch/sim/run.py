"""Run a scenario end to end: one virtual GPU and one real Monitor per rank, one shared run id.

``run_scenario`` is what ``memwatch demo`` and the tests call. It never raises for what the simulated
engine dies of (an OOM, a KV cache with no room, a request that can never fit): those end the run the
way they would end a real one — an ``oom`` event and closed rings, or for a crash outside PyTorch's
allocator a ring its writer never closed — and come back in the result's
``status`` and ``error``. Bad scenarios and an unusable runtime directory do raise, as
:class:`memwatch.errors.MemwatchError` subclasses with one-line messages.
"""

from __future__ import annotations

import dataclasses
import os
import time

from memwatch.errors import MemwatchError, UnavailableError
from memwatch.sim.clock import VirtualClock
from memwatch.sim.engine import SimulatedEngine
from memwatch.sim.gpu import SimulatedCrash, SimulatedOutOfMemory, VirtualGPU
from memwatch.sim.result import PhaseSummary, RankSummary, SimulationResult
from memwatch.sim.runner import RankRunner
from memwatch.sim.scenario import Scenario
from memwatch_engine import Monitor
from memwatch_engine.monitor import new_run_id
from memwatch_engine.ring import DEFAULT_CAPACITY


def run_scenario(
    scenario: Scenario | str | os.PathLike[str],
    *,
    runtime_dir: str | os.PathLike[str] | None = None,
    run_id: str | None = None,
    spawn_sidecar: bool = False,
    start_ns: int | None = None,
    capacity: int = DEFAULT_CAPACITY,
    speed: float | None = None,
) -> SimulationResult:
    """Simulate ``scenario`` (a :class:`Scenario`, a scenario file or a shipped name) on every rank.

    ``start_ns`` is where the virtual clock starts (default: now), ``runtime_dir`` where the rings go
    (default: memwatch's runtime directory), ``spawn_sidecar`` whether the Monitors may start one,
    ``speed`` how many virtual seconds pass per wall-clock second (default: as fast as possible).
    """
    if not isinstance(scenario, Scenario):
        scenario = Scenario.load(scenario)
    spec = scenario.model_spec()
    requests = scenario.workload.generate(scenario.seed)
    engine_config = scenario.engine
    run_id = run_id or new_run_id()
    clock = VirtualClock(time.time_ns() if start_ns is None else start_ns, speed=speed)
    wall_start = time.perf_counter_ns()

    runners = []
    for rank in range(engine_config.tensor_parallel_size):
        gpu = VirtualGPU(scenario.gpu.total_bytes, context_bytes=scenario.gpu.context_bytes,
                         device_name=scenario.gpu.name, index=rank)
        monitor = Monitor(
            engine=engine_config.rules, model=spec.name, rank=rank, world_size=engine_config.tensor_parallel_size,
            run_id=run_id, probe=gpu, runtime_dir=runtime_dir, config={"scenario": scenario.name},
            capacity=capacity, spawn_sidecar=spawn_sidecar, clock=clock.now_ns, source="sim",
            close_at_exit=False,  # the simulation ends each rank itself; a simulated crash stays open
        )
        if not monitor.enabled:
            for runner in runners:
                runner.monitor.close("error")
            raise UnavailableError(f"cannot record the simulated run: rank {rank}'s monitor could not open its "
                                   "ring (see the warning above); check MEMWATCH_RUNTIME_DIR")
        runners.append(RankRunner(rank, spec, engine_config, gpu, monitor, clock, scenario.faults))

    engine = SimulatedEngine(engine_config, scenario.cost, runners, clock, scenario.model_file())
    error: str | None = None
    try:
        engine.start()
        engine.serve(requests)
        status = "ok"
    except SimulatedOutOfMemory as exc:
        status, error = "oom", str(exc)
    except SimulatedCrash as exc:
        status, error = "crashed", str(exc)
    except MemwatchError as exc:
        status, error = "error", str(exc)
    for runner in runners:
        if runner.status == "running":
            runner.status = "ok" if status == "ok" else "error"
        if runner.status != "crashed":  # a crashed process never closes its ring: the sidecar sees it die
            runner.monitor.close(runner.status)

    stats = engine.stats
    return SimulationResult(
        run_id=run_id, scenario=scenario.name, model=spec.name, status=status,
        ranks=tuple(_rank_summary(runner, engine) for runner in runners),
        requests=stats.requests, finished_requests=stats.finished, steps=stats.steps,
        preemptions=stats.preemptions, max_resident_requests=stats.max_resident_requests,
        max_kv_blocks_used=stats.max_kv_blocks_used,
        virtual_duration_ns=clock.elapsed_ns, wall_duration_ns=time.perf_counter_ns() - wall_start,
        error=error, faults=[fault.to_dict() for fault in scenario.faults],
    )


def _rank_summary(runner: RankRunner, engine: SimulatedEngine) -> RankSummary:
    sizing = runner.kv_sizing
    stats = engine.stats
    return RankSummary(
        rank=runner.rank,
        run_id=runner.monitor.run_id,
        status=runner.status,
        phases=tuple(PhaseSummary(p.name, p.wall_ns, p.virtual_ns) for p in runner.phases),
        weights_bytes=runner.weights_bytes,
        activation_reserve_bytes=None if sizing is None else sizing.peak_bytes - sizing.current_bytes,
        non_torch_bytes=None if sizing is None else sizing.used_bytes - sizing.reserved_bytes,
        cache_slack_bytes=None if sizing is None else sizing.reserved_bytes - sizing.current_bytes,
        num_blocks=None if sizing is None else sizing.num_blocks,
        block_bytes=None if sizing is None else sizing.block_bytes,
        kv_tokens=None if sizing is None else sizing.num_blocks * runner.engine.block_size,
        max_resident_requests=stats.max_resident_requests,
        preemptions=stats.preemptions,
        steps=stats.steps,
        oom=runner.status == "oom",
        ring_path=None if runner.monitor.ring_path is None else str(runner.monitor.ring_path),
        kv_sizing=None if sizing is None else dataclasses.asdict(sizing),
        oom_details=runner.oom_details,
        crash_details=runner.crash_details,
    )
