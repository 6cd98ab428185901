"""One engine of a simulated fleet: the simulator's engine served step by step, on a clock of its own.

:class:`memwatch.sim.engine.SimulatedEngine` serves a whole workload in one call; a fleet needs each engine
to take requests as a router hands them over and to run only up to a given instant, so that every
engine and the router move in lock-step. :class:`FleetEngine` drives the same startup, scheduler, block
manager, forwards and Monitor calls (it reuses ``SimulatedEngine._step``); it adds when each request was
first scheduled and when it finished, and it ends the engine for good when its GPU runs out of memory.

Its records are stamped on this host's wall clock, when the simulation writes them, as a real engine's are:
its sidecar then ages them as it ages any engine's, with the staleness a deployment runs with. The simulated
clock decides what happens and when (the schedule, the router's ticks, the results); it never reaches a ring.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from memwatch.errors import MemwatchError, UnavailableError
from memwatch.sim.blocks import BlockManager
from memwatch.sim.clock import VirtualClock
from memwatch.sim.engine import SimulatedEngine
from memwatch.sim.faults import Fault
from memwatch.sim.gpu import SimulatedCrash, SimulatedOutOfMemory, VirtualGPU
from memwatch.sim.runner import RankRunner
from memwatch.sim.scenario import Scenario
from memwatch.sim.scheduler import Scheduler
from memwatch.sim.sequence import Sequence
from memwatch_engine import Monitor


@dataclass(frozen=True)
class FleetRequest:
    """A request of the trace, as the router sees it: its lengths and when it reached the router."""

    request_id: int
    prompt_tokens: int
    output_tokens: int
    arrival_ns: int
    """Virtual nanoseconds after the trace starts."""
    stop_tokens: int | None = None
    """Outputs before its end of sequence (``None``: ``output_tokens``); the engine's to find out, never the
    router's: no policy may read it."""

    @property
    def generated_tokens(self) -> int:
        return self.output_tokens if self.stop_tokens is None else self.stop_tokens


class _TimedScheduler(Scheduler):
    """nano-vllm's scheduler, noting when each request is first scheduled and when it finishes."""

    def __init__(self, manager: BlockManager, now: Callable[[], int], *, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        super().__init__(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        self._now = now
        self.started_ns: dict[int, int] = {}
        self.finished_ns: dict[int, int] = {}

    def schedule(self) -> tuple[list[Sequence], bool]:
        seqs, is_prefill = super().schedule()
        now = self._now()
        for seq in seqs:
            self.started_ns.setdefault(seq.seq_id, now)
        return seqs, is_prefill

    def postprocess(self, seqs: list[Sequence], is_prefill: bool) -> list[Sequence]:
        finished = super().postprocess(seqs, is_prefill)
        now = self._now()  # the step's time has been added by now
        for seq in finished:
            self.finished_ns[seq.seq_id] = now
        return finished


class FleetEngine:
    """Engine ``index`` of the fleet: its own virtual GPU per rank, Monitors writing rings into ``runtime_dir``."""

    def __init__(self, index: int, scenario: Scenario, faults: tuple[Fault, ...], runtime_dir: Path,
                 start_ns: int, run_id: str) -> None:
        self.index = index
        self.scenario = scenario
        config = scenario.engine
        spec = scenario.model_spec()
        self.clock = VirtualClock(start_ns)
        runners: list[RankRunner] = []
        for rank in range(config.tensor_parallel_size):
            gpu = VirtualGPU(scenario.gpu.total_bytes, context_bytes=scenario.gpu.context_bytes,
                             device_name=scenario.gpu.name, index=rank)
            monitor = Monitor(engine=config.rules, model=spec.name, rank=rank,
                              world_size=config.tensor_parallel_size, run_id=run_id, probe=gpu,
                              runtime_dir=runtime_dir, config={"scenario": scenario.name, "fleet_engine": index},
                              spawn_sidecar=False, source="sim",  # the default clock: this host's wall clock
                              close_at_exit=False)  # pragma: no mutate (only its truth is read: None is False)
            if not monitor.enabled:
                for runner in runners:
                    runner.monitor.close("error")
                raise UnavailableError(f"engine {index}: rank {rank}'s monitor could not open its ring in "
                                       f"{runtime_dir}")
            runners.append(RankRunner(rank, spec, config, gpu, monitor, self.clock, faults))
        self.runners = runners
        self.sim = SimulatedEngine(config, scenario.cost, runners, self.clock)
        self.status = "starting"
        """``starting``, ``serving``, then ``oom``, ``crashed`` or ``error`` when it died, ``closed`` at the end."""
        self.error: str | None = None
        self.pending: deque[Sequence] = deque()
        self.requests: dict[int, FleetRequest] = {}
        self._serve: ExitStack | None = None
        self._scheduler: _TimedScheduler | None = None

    @property
    def alive(self) -> bool:
        return self.status == "serving"

    @property
    def ring_paths(self) -> list[Path]:
        return [runner.monitor.ring_path for runner in self.runners if runner.monitor.ring_path is not None]

    def start(self) -> None:
        """Load, warm up, size the KV cache, capture graphs and enter serving (or die trying)."""
        try:
            self.sim.start()
        except (SimulatedOutOfMemory, SimulatedCrash, MemwatchError) as exc:
            self._die(exc)
            return
        sizing = self.runners[0].kv_sizing
        assert sizing is not None
        config = self.scenario.engine
        self._scheduler = _TimedScheduler(BlockManager(sizing.num_blocks, config.block_size), self.clock.now_ns,
                                          max_num_seqs=config.max_num_seqs,
                                          max_num_batched_tokens=config.max_num_batched_tokens)
        self._serve = ExitStack()
        self._serve.enter_context(self.sim.phase("serve"))
        self.status = "serving"
        # An empty step says the KV cache is free and nothing runs, so the sidecar's headroom signal is
        # complete before the first request (a router would otherwise see an idle engine as unknown).
        self._empty_step(self._scheduler.block_manager)

    def submit(self, request: FleetRequest, serving_start_ns: int) -> None:
        """Queue a request the router sent here; it reaches the engine at its arrival time."""
        self.requests[request.request_id] = request
        self.pending.append(Sequence(request.request_id, request.prompt_tokens, request.output_tokens,
                                     serving_start_ns + request.arrival_ns, request.stop_tokens))

    def advance_to(self, until_ns: int) -> None:
        """Run every step that begins before ``until_ns`` (the last one may end after it), idling otherwise."""
        scheduler = self._scheduler
        while self.alive and self.clock.now_ns() < until_ns:
            assert scheduler is not None
            while self.pending and self.pending[0].arrival_ns <= self.clock.now_ns():
                seq = self.pending.popleft()
                self.sim.stats.requests += 1
                self.sim._arrive(scheduler, seq)
            if scheduler.is_finished():
                self.clock.advance_to(min(self.pending[0].arrival_ns, until_ns) if self.pending else until_ns)
                continue
            try:
                self.sim._step(scheduler, scheduler.block_manager)
            except (SimulatedOutOfMemory, SimulatedCrash, MemwatchError) as exc:
                self._die(exc)
            else:
                if scheduler.is_finished():
                    # A step's sample reads the blocks before the requests it finished free them, and an idle
                    # engine steps no more: without this its last sample would show the freed blocks held for as
                    # long as it idles. vLLM's engine core schedules once more after its last finish: a step of
                    # nothing.
                    self._empty_step(scheduler.block_manager)

    def _empty_step(self, manager: BlockManager) -> None:
        """A step that schedules nothing: nothing running or waiting, the blocks the cache holds (none)."""
        self.runners[0].monitor.step(num_seqs=0, num_tokens=0, kv_blocks_used=manager.num_used,
                                     kv_blocks_total=manager.num_blocks, requests_running=0, requests_waiting=0,
                                     kv_blocks_needed=0)
        for runner in self.runners[1:]:
            runner.monitor.step()

    def _die(self, exc: BaseException) -> None:
        """The engine's process ends: an OOM is recorded by the rank it hit (inside the serving phase), the
        rings close, and every request it held is lost."""
        self.status = {SimulatedOutOfMemory: "oom", SimulatedCrash: "crashed"}.get(type(exc), "error")
        self.error = str(exc)
        if self._serve is not None:  # it died serving
            try:
                with self._serve:  # the serve phase sees the exception: it records an OOM and lets it through
                    raise exc
            except (SimulatedOutOfMemory, SimulatedCrash, MemwatchError):
                pass  # it ends here
        for runner in self.runners:
            if runner.status == "running":
                runner.status = "error" if self.status == "error" else "ok"
            if runner.status != "crashed":
                runner.monitor.close(runner.status)

    def close(self) -> None:
        """End serving and close the rings (an engine that died closed them already)."""
        if self.status != "serving":
            return
        assert self._serve is not None  # entered with serving
        self._serve.close()
        for runner in self.runners:
            runner.status = "ok"
            runner.monitor.close("ok")
        self.status = "closed"

    # -- what the fleet reports ------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether it still has work queued or running."""
        return self.alive and (bool(self.pending) or not (self._scheduler is None or self._scheduler.is_finished()))

    @property
    def started_ns(self) -> dict[int, int]:
        return {} if self._scheduler is None else self._scheduler.started_ns

    @property
    def finished_ns(self) -> dict[int, int]:
        return {} if self._scheduler is None else self._scheduler.finished_ns

    @property
    def preemptions(self) -> int:
        return self.sim.stats.preemptions
