"""Run a recorded workload through the simulated engine with a calibrated memory model, under new settings.

Each rank is a :class:`memwatch.sim.runner.RankRunner` whose startup and forwards come from the
calibration instead of a model config: the long-lived PyTorch memory as one allocation, the warmup's
activation reserve, nano-vllm's KV formula on the virtual GPU's readings, the CUDA-graph memory; per
step, the recorded non-PyTorch level (a rise that filled the recorded device is another process taking
whatever is free here too), the temporaries and long-lived tensors recorded beside the forwards, and
the forward itself: the activation fit, allocated as a known model's tensors scaled to it (else as one
block). The scheduler, block manager, caching allocator, clock and Monitor are the simulator's own, so
the replay is recorded like any simulated run.

Changing a setting scales what it shapes: ``--tp`` divides the weights, KV block, activations and graph
memory per rank by the new size over the old (and adds NCCL buffers going from one rank to several);
``--block-size`` scales the KV block; ``--max-num-seqs`` scales the graph pool and moves the warmup
reserve along the activation fit, as a new warmup shape would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memwatch.errors import MemwatchError, UsageError
from memwatch.models import warmup_batch
from memwatch.replay.calibrate import Calibration, EngineSettings, RankModel
from memwatch.replay.scaling import Forward, Tensors, TPScale, eager_attention_floor, forward_tensors, tp_scale
from memwatch.replay.vllm_budget import vllm_budget
from memwatch.replay.workload import RecordedWorkload
from memwatch.sim.clock import VirtualClock
from memwatch.sim.engine import SimulatedEngine
from memwatch.sim.forward import TensorOp
from memwatch.sim.gpu import LARGE_SEGMENT_ROUNDING, ROUNDING, SimulatedOutOfMemory, VirtualGPU
from memwatch.sim.runner import MAX_GRAPH_BATCH, RankRunner
from memwatch.sim.scenario import CostModel, EngineConfig
from memwatch_engine import Monitor
from memwatch_engine.monitor import new_run_id

NCCL_BYTES = 128 << 20
"""NCCL buffers a rank takes outside PyTorch once there is more than one rank (the simulator's figure)."""

OTHER_PROCESS = "other-process"
"""The owner of memory another process took on a replayed device."""

ARRIVAL_SLACK_NS = 1000
"""Arrivals move this much earlier, so that a fitted step time a nanosecond off never slips one by a step."""


@dataclass(frozen=True)
class Settings:
    """What a replay changes; ``None`` keeps the recorded value."""

    utilization: float | None = None
    gpu_memory_bytes: int | None = None
    tp: int | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    load: float = 1.0

    def describe(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if value is not None}


@dataclass(frozen=True)
class ReplayResult:
    run_id: str
    status: str
    error: str | None
    engine: EngineConfig
    steps: int
    preemptions: int
    virtual_duration_ns: int


def engine_config(settings: EngineSettings, change: Settings, rules: str = "nano-vllm") -> EngineConfig:
    """The engine settings of the replay; a value the recorded engine (``rules``) would refuse is a
    :class:`UsageError`."""
    return EngineConfig(
        rules=rules,
        gpu_memory_utilization=settings.gpu_memory_utilization if change.utilization is None else change.utilization,
        block_size=settings.block_size if change.block_size is None else change.block_size,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs if change.max_num_seqs is None else change.max_num_seqs,
        max_model_len=settings.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size if change.tp is None else change.tp,
        enforce_eager=settings.enforce_eager,
    )


class CalibratedRunner(RankRunner):
    """One rank whose memory follows a calibrated :class:`RankModel`, rescaled to the new settings."""

    def __init__(self, rank: int, model: RankModel, recorded: EngineSettings, engine: EngineConfig,
                 gpu: VirtualGPU, monitor: Monitor, clock: VirtualClock, tp: TPScale,
                 floor: Forward | None = None, tensors: Tensors | None = None) -> None:
        super().__init__(rank, None, engine, gpu, monitor, clock)  # type: ignore[arg-type]
        self.model = model
        self.recorded = recorded
        self.scale = recorded.tensor_parallel_size / engine.tensor_parallel_size
        self.tp_scale = tp
        self.floor = floor
        self.tensors = tensors
        self._outside = dict(model.outside_levels)
        self._last_recorded_step = max(self._outside, default=0)
        self._greedy_steps = set(model.greedy_steps)
        self._level = 0
        """The recorded level followed so far: ``_greedy`` of it another process's, ``_own`` this one's."""
        self._greedy = 0
        self._own = 0
        self._start_outside = 0

    def _outside_at_start(self) -> int:
        """Memory outside PyTorch before loading: so that ``used`` at sizing is what the run measured."""
        model = self.model
        slack = model.reserved_bytes - _round_up(model.current_bytes, LARGE_SEGMENT_ROUNDING)
        nccl = 0
        if self.recorded.tensor_parallel_size == 1 and self.tp > 1:
            nccl = NCCL_BYTES
        elif self.recorded.tensor_parallel_size > 1 and self.tp == 1:
            nccl = -min(NCCL_BYTES, model.non_torch_bytes)
        return max(0, model.non_torch_bytes + slack + nccl)

    def load_weights(self) -> None:
        current = _round_up(round(self.model.current_bytes * self.tp_scale.weights), ROUNDING)
        self._start_outside = self._outside_at_start()
        self.gpu.take_non_pytorch("outside", self._start_outside)
        self._persistent.append(self.gpu.malloc(current))
        self.weights_bytes = self.gpu.allocated_bytes
        self.monitor.weights_loaded()

    def warmup(self) -> None:
        self.gpu.empty_cache()
        self.gpu.reset_peak_memory_stats()
        self.gpu.free(self.gpu.malloc(self._reserve()))
        self.gpu.empty_cache()

    def _reserve(self) -> int:
        """The recorded reserve, moved along the activation fit when the warmup's shape changes."""
        reserve = (self.model.activation_reserve_bytes + self._reserve_shift()) * self.tp_scale.reserve
        return max(ROUNDING, _round_up(round(reserve), ROUNDING))

    def _reserve_shift(self) -> int:
        """How far the activation fit moves the warmup's peak from the recorded shape to the new one."""
        model, recorded, engine = self.model, self.recorded, self.engine
        old = warmup_batch(recorded.max_num_batched_tokens, recorded.max_model_len, recorded.max_num_seqs)
        new = warmup_batch(engine.max_num_batched_tokens, engine.max_model_len, engine.max_num_seqs)
        return model.activation(new[0] * new[1], new[0]) - model.activation(old[0] * old[1], old[0])

    def warmup_shape(self) -> tuple[int, int]:
        engine = self.engine
        return warmup_batch(engine.max_num_batched_tokens, engine.max_model_len, engine.max_num_seqs)

    def kv_budget(self, total: int, used: int, peak: int, current: int) -> tuple[int, dict[str, Any]]:
        """vLLM's rule for a run vLLM sized (:mod:`memwatch.replay.vllm_budget`), SGLang's for a run SGLang
        sized (:mod:`memwatch.replay.sglang_budget`), else nano-vllm's."""
        model = self.model
        if model.sglang is not None:
            recorded = model.sglang
            device = total - model.total_bytes
            weights = round(model.current_bytes * self.tp_scale.weights) - model.current_bytes
            return self.sglang_budget(recorded.free_bytes + device - weights, recorded.pre_load_free_bytes + device,
                                      recorded.mm_reservation_gb, recorded.fixed_overhead_bytes)
        if model.vllm_non_kv_bytes is None:
            return super().kv_budget(total, used, peak, current)
        weights = round(model.current_bytes * self.tp_scale.weights) - model.current_bytes
        reserve = round((model.activation_reserve_bytes + self._reserve_shift()) * self.tp_scale.reserve)
        non_kv = model.vllm_non_kv_bytes + weights + reserve - model.activation_reserve_bytes
        budget = vllm_budget(total, self.engine.gpu_memory_utilization, non_kv, model.vllm_fixed_kv_bytes)
        return budget, {"budget_rule": "vllm", "kv_cache_memory_bytes": budget}

    def block_bytes(self) -> int:
        model = self.model
        return round(model.block_bytes * self.engine.block_size / self.recorded.block_size * self.scale)

    def capture_cudagraph(self) -> list[int]:
        old = min(self.recorded.max_num_seqs, MAX_GRAPH_BATCH)
        new = min(self.engine.max_num_seqs, MAX_GRAPH_BATCH)
        nbytes = round(self.model.graph_bytes * self.tp_scale.activation_per_token * new / old)
        if nbytes:
            self._persistent.append(self.gpu.malloc(nbytes))
        self.graph_batch_limit = new
        return [new]

    def before_step(self, step: int) -> None:
        """Follow the recorded memory outside PyTorch, then the allocations the recording shows beside the
        forwards (:mod:`memwatch.replay.transients`)."""
        self._follow_outside(step)
        event = self.model.transients.at(step)
        if event is None:
            return
        if event.kept_bytes and not event.pinned:
            self._persistent.append(self.gpu.malloc(event.kept_bytes))
        temporary = self.gpu.malloc(event.temporary_bytes) if event.temporary_bytes else None
        if event.kept_bytes and event.pinned:
            self._persistent.append(self.gpu.malloc(event.kept_bytes))
        if temporary is not None:
            self.gpu.free(temporary)

    def _follow_outside(self, step: int) -> None:
        """The recorded non-PyTorch level; past the recording, its last growth rate. A rise that left the
        recorded device full was another process taking all that was free: it takes all that is free here."""
        if step in self._outside:
            level = self._outside[step]
        elif step > self._last_recorded_step and self.model.outside_growth_per_step:
            level = self._level + round(self.model.outside_growth_per_step)
        else:
            return
        if step in self._greedy_steps and level > self._level:
            self._greedy += level - self._level
            self._level = level
            self.gpu.take_other_process(OTHER_PROCESS, self.gpu.driver_free_bytes)
            return
        if level < self._level and self._greedy:
            self.gpu.release_other_process(OTHER_PROCESS)  # the other process exited
            self._greedy = 0
        own, held = level - self._greedy, self._own
        self._level, self._own = level, own
        if own > held:
            self.gpu.take_non_pytorch("outside", own - held)  # raises when the driver has no room
        elif own < held:
            self.gpu.release_non_pytorch("outside")
            self.gpu.take_non_pytorch("outside", max(0, self._start_outside + own))

    def forward(self, num_tokens: int, num_seqs: int, *, prefill: bool, max_seq_len: int) -> int:
        if not prefill and num_seqs <= self.graph_batch_limit:
            return 0
        model = self.model
        per_token = model.activation_per_token * self.tp_scale.activation_per_token
        nbytes = round(per_token * num_tokens + model.activation_per_seq * num_seqs)
        if self.floor is not None:
            nbytes = max(nbytes, self.floor(num_tokens, num_seqs, prefill, max_seq_len))
        if nbytes <= 0:
            return 0
        if self.tensors is None:
            self.gpu.free(self.gpu.malloc(nbytes))
            return nbytes
        ops = self.tensors(num_tokens, num_seqs, prefill, max_seq_len)
        factor = nbytes / max(_peak(ops), 1)
        live: dict[str, int] = {}
        for op in ops:  # the model's tensors, in its order, scaled to the calibrated bytes
            if op.nbytes:
                live[op.name] = self.gpu.malloc(max(1, round(op.nbytes * factor)))
            else:
                self.gpu.free(live.pop(op.name))
        return nbytes


def _peak(ops: list[TensorOp]) -> int:
    """The most bytes a forward's requests hold at once."""
    sizes: dict[str, int] = {}
    held = peak = 0
    for op in ops:
        if op.nbytes:
            sizes[op.name] = op.nbytes
            held += op.nbytes
            peak = max(peak, held)
        else:
            held -= sizes.pop(op.name)
    return peak


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def replay(calibration: Calibration, workload: RecordedWorkload, change: Settings, *,
           runtime_dir: str | Path, start_ns: int | None = None, run_id: str | None = None) -> ReplayResult:
    """Serve ``workload`` on simulated ranks calibrated from a run, under ``change``; rings go to ``runtime_dir``."""
    engine = engine_config(calibration.settings, change, calibration.budget_rule)
    sglang = calibration.ranks[0].sglang
    if sglang is not None:  # SGLang's own page size and cap, as recorded
        engine = replace(engine, page_size=sglang.page_size, max_total_tokens=sglang.max_total_tokens)
    if change.gpu_memory_bytes is not None and change.gpu_memory_bytes <= 0:
        raise UsageError("--gpu-memory must be a positive number of bytes")
    run_id = run_id or new_run_id()
    clock = VirtualClock(time.time_ns() if start_ns is None else start_ns)
    requests = [replace(r, arrival_ns=max(0, r.arrival_ns - ARRIVAL_SLACK_NS))
                for r in workload.requests_at(change.load)]
    too_long = max(r.prompt_tokens + r.output_tokens for r in requests)
    if too_long > engine.max_model_len:
        engine = replace(engine, max_model_len=too_long)
    models = {model.rank: model for model in calibration.ranks}
    config = {"replay_of": calibration.run_id, "replay_settings": change.describe(), "scenario": "replay"}
    runners: list[CalibratedRunner] = []
    floor = eager_attention_floor(calibration.model, calibration.dtype, calibration.attention,
                                  engine.tensor_parallel_size)
    tensors = forward_tensors(calibration.model, calibration.dtype, calibration.attention,
                              engine.tensor_parallel_size)
    scale = tp_scale(calibration.model, calibration.dtype, calibration.attention,
                     calibration.settings.tensor_parallel_size, engine.tensor_parallel_size,
                     warmup_batch(engine.max_num_batched_tokens, engine.max_model_len, engine.max_num_seqs))
    for rank in range(engine.tensor_parallel_size):
        model = models.get(rank, models[0])
        total = model.total_bytes if change.gpu_memory_bytes is None else change.gpu_memory_bytes
        gpu = VirtualGPU(total, context_bytes=0, device_name=calibration.gpu_name or "Virtual GPU", index=rank)
        monitor = Monitor(engine=calibration.budget_rule, model=calibration.model, rank=rank,
                          world_size=engine.tensor_parallel_size, run_id=run_id, probe=gpu,
                          runtime_dir=runtime_dir, config=config, spawn_sidecar=False, clock=clock.now_ns,
                          source="sim")
        runners.append(CalibratedRunner(rank, model, calibration.settings, engine, gpu, monitor, clock, scale,
                                        floor, tensors))
    cost = calibration.cost
    simulated = SimulatedEngine(engine, CostModel(prefill_tokens_per_s=cost.prefill_tokens_per_s,
                                                  decode_step_s=cost.decode_step_s,
                                                  decode_per_seq_s=cost.decode_per_seq_s), runners, clock)
    status, error = "ok", None
    try:
        _start(simulated, runners)
        simulated.serve(requests)
    except SimulatedOutOfMemory as exc:
        status, error = "oom", str(exc)
    except MemwatchError as exc:
        status, error = "error", str(exc)
    for runner in runners:
        if runner.status == "running":
            runner.status = "ok" if status == "ok" else "error"
        runner.monitor.close(runner.status)
    stats = simulated.stats
    return ReplayResult(run_id, status, error, engine, stats.steps, stats.preemptions, clock.elapsed_ns)


def _start(simulated: SimulatedEngine, runners: list[CalibratedRunner]) -> None:
    """Startup as the simulated engine runs it, with the settings recorded as a config event."""
    engine = simulated.engine
    for runner in runners:
        runner.monitor.set_config(
            gpu_memory_utilization=engine.gpu_memory_utilization, block_size=engine.block_size,
            max_num_batched_tokens=engine.max_num_batched_tokens, max_num_seqs=engine.max_num_seqs,
            max_model_len=engine.max_model_len, tensor_parallel_size=engine.tensor_parallel_size,
            enforce_eager=engine.enforce_eager,
        )
    for phase, method in (("load", "load_weights"), ("warmup", "warmup"), ("kv_alloc", "allocate_kv_cache")):
        with simulated.phase(phase):
            for runner in runners:
                getattr(runner, method)()
    if not engine.enforce_eager:
        with simulated.phase("cudagraph"):
            for runner in runners:
                runner.capture_cudagraph()
