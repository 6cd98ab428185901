"""The shipped fault kinds beyond ``other_process``: each one a way serving memory goes wrong.

They register on import (:func:`memwatch.sim.faults.register_fault`); the scenario loader imports
this module, so every kind below is accepted in scenario files by its ``kind``:

==================  ==========================================================================
``non_torch_leak``  memory outside the allocator grows by ``bytes_per_step`` from ``from_step``
``torch_leak``      tensors kept alive inside the allocator: ``bytes_per_step`` every ``every_steps``, or
                    ``bytes_per_request`` for each request that finishes
``fragmentation``   the allocator's cache holds more and more memory no tensor uses
``skip_peak_reset`` the load-time spike stays in the peak warmup measures (reserve overstated)
``warmup_decode``   warmup runs a decode step instead of the worst-case prefill
``warmup_short``    warmup runs a prefill of only ``tokens`` tokens
``long_prefill``    a request longer than warmup covered arrives at ``at_step``
``rank_imbalance``  one rank has less free memory when the KV cache is sized
==================  ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memwatch.errors import UsageError
from memwatch.sim.config import EngineConfig
from memwatch.sim.faults import FAULT_KINDS, ExtraRequest, Fault, FaultTarget, OtherProcess, register_fault
from memwatch.sim.gpu import ROUNDING, SMALL_REQUEST_LIMIT, MiB

__all__ = [
    "FAULT_KINDS",
    "Fragmentation",
    "LongPrefill",
    "NonTorchLeak",
    "OtherProcess",
    "RankImbalance",
    "SkipPeakReset",
    "TorchLeak",
    "WarmupDecode",
    "WarmupShort",
]


def _check_window(kind: str, from_step: int, until_step: int | None) -> None:
    if from_step < 1:
        raise UsageError(f"fault {kind}: from_step must be at least 1 (serving steps count from 1)")
    if until_step is not None and until_step <= from_step:
        raise UsageError(f"fault {kind}: until_step must come after from_step")


def _in_window(step: int, from_step: int, until_step: int | None, every_steps: int = 1) -> bool:
    if step < from_step or (until_step is not None and step >= until_step):
        return False
    return (step - from_step) % every_steps == 0


@register_fault
@dataclass(frozen=True)
class NonTorchLeak(Fault):
    """Memory outside PyTorch's allocator grows by ``bytes_per_step`` each step in ``[from_step, until_step)``.

    What a leaking extension, a per-request workspace or an ever-growing NCCL/cuBLAS cache looks like
    from outside: driver ``used`` rises while ``reserved`` does not. When the driver has no room left
    the leaking allocation itself runs out of memory.
    """

    kind: ClassVar[str] = "non_torch_leak"
    bytes_per_step: int = 0
    from_step: int = 1
    until_step: int | None = None
    name: str = "leak"

    def __post_init__(self) -> None:
        if self.bytes_per_step <= 0:
            raise UsageError(f"fault {self.kind} needs bytes_per_step > 0")
        _check_window(self.kind, self.from_step, self.until_step)

    @property
    def start_step(self) -> int:
        return self.from_step

    def before_step(self, runner: FaultTarget, step: int) -> None:
        if _in_window(step, self.from_step, self.until_step):
            runner.gpu.take_non_pytorch(self.name, self.bytes_per_step)


@register_fault
@dataclass(frozen=True)
class TorchLeak(Fault):
    """A tensor of ``bytes_per_step`` kept alive every ``every_steps`` steps in ``[from_step, until_step)``.

    What logprobs or outputs held per request, metadata per prefix-cache entry or a graph pool per new
    batch shape look like: PyTorch memory that outlives the step that made it. Allocated through the
    caching allocator before the step's forward, so the leak takes the cache first, then the driver,
    and the forward that no longer fits raises a PyTorch out-of-memory. ``until_step`` makes it level
    off; with a large ``every_steps`` and a short window it is one-time growth (graphs captured for a
    few new batch sizes, a buffer allocated once), which is no leak.
    """

    kind: ClassVar[str] = "torch_leak"
    bytes_per_step: int = 0
    from_step: int = 1
    every_steps: int = 1
    until_step: int | None = None
    bytes_per_request: int = 0
    """Kept for each request that finishes in the window instead (outputs held per request): the leak
    then follows the traffic, not the step count."""

    def __post_init__(self) -> None:
        if (self.bytes_per_step <= 0) == (self.bytes_per_request <= 0) or self.every_steps < 1:
            raise UsageError(f"fault {self.kind} needs one of bytes_per_step > 0 or bytes_per_request > 0, "
                             "and every_steps >= 1")
        _check_window(self.kind, self.from_step, self.until_step)

    @property
    def start_step(self) -> int:
        return self.from_step

    def kept_after(self, step: int) -> int:
        """Bytes this fault keeps alive per step once serving step ``step`` ran (0 for a per-request leak)."""
        last = step + 1 if self.until_step is None else min(step + 1, self.until_step)
        if last <= self.from_step or not self.bytes_per_step:
            return 0
        return self.bytes_per_step * ((last - self.from_step - 1) // self.every_steps + 1)

    def before_step(self, runner: FaultTarget, step: int) -> None:
        if self.bytes_per_step and _in_window(step, self.from_step, self.until_step, self.every_steps):
            runner.gpu.malloc(self.bytes_per_step)

    def requests_finished(self, runner: FaultTarget, step: int, count: int) -> None:
        if self.bytes_per_request and _in_window(step, self.from_step, self.until_step):
            for _ in range(count):
                runner.gpu.malloc(self.bytes_per_request)


@register_fault
@dataclass(frozen=True)
class Fragmentation(Fault):
    """Every ``every_steps`` steps in ``[from_step, until_step)``: a temporary, and a long-lived tensor born beside it.

    The classic way a caching allocator fragments under a growing batch. Event ``k`` (from 0)
    allocates a temporary of exactly ``temporary_bytes + k * growth_bytes``; while it is alive, a
    small long-lived tensor of ``pin_bytes`` (a per-request buffer that is never freed) is allocated;
    then the temporary is freed. Where each lands is the allocator's own best-fit choice, as in
    PyTorch: a temporary larger than every cached hole gets a new segment, and a long-lived tensor
    that lands in a segment's free tail keeps the whole segment from being released. The freed
    temporary is then a hole the next, larger one does not fit. ``pin_bytes`` defaults to the
    smallest request of the large pool (1 MiB + 512), the pool that holds activations; a temporary
    of ``n`` MiB + 512 bytes (``n`` even) leaves its segment a tail of 2 MiB - 512 bytes, which such
    a tensor fills.
    """

    kind: ClassVar[str] = "fragmentation"
    temporary_bytes: int = 64 * MiB
    growth_bytes: int = 2 * MiB
    pin_bytes: int = SMALL_REQUEST_LIMIT + ROUNDING
    from_step: int = 1
    every_steps: int = 1
    until_step: int | None = None

    def __post_init__(self) -> None:
        if self.temporary_bytes <= 0 or self.pin_bytes <= 0 or self.growth_bytes < 0 or self.every_steps < 1:
            raise UsageError(f"fault {self.kind} needs temporary_bytes > 0, pin_bytes > 0, growth_bytes >= 0 "
                             "and every_steps >= 1")
        _check_window(self.kind, self.from_step, self.until_step)

    @property
    def start_step(self) -> int:
        return self.from_step

    def temporary_at(self, event: int) -> int:
        """The size of event ``event``'s temporary (events count from 0)."""
        return self.temporary_bytes + event * self.growth_bytes

    def before_step(self, runner: FaultTarget, step: int) -> None:
        if not _in_window(step, self.from_step, self.until_step, self.every_steps):
            return
        gpu = runner.gpu
        temporary = gpu.malloc(self.temporary_at((step - self.from_step) // self.every_steps))
        gpu.malloc(self.pin_bytes)
        gpu.free(temporary)


@register_fault
@dataclass(frozen=True)
class SkipPeakReset(Fault):
    """Warmup does not reset the allocator's peak, so the load-time spike counts as activation reserve.

    ``staging_bytes`` sets the transient copy made while loading (default: one decoder layer); the
    reserve is overstated and the KV cache gets fewer blocks than the GPU could hold.
    """

    kind: ClassVar[str] = "skip_peak_reset"
    staging_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.staging_bytes is not None and self.staging_bytes <= 0:
            raise UsageError(f"fault {self.kind}: staging_bytes must be positive (or left out)")

    def setup(self, runner: FaultTarget) -> None:
        runner.behaviour.reset_peak_before_warmup = False
        if self.staging_bytes is not None:
            runner.behaviour.load_staging_bytes = self.staging_bytes


@register_fault
@dataclass(frozen=True)
class WarmupDecode(Fault):
    """Warmup runs its batch as one decode step (``[1, L]`` attention), not a prefill: the reserve is too small."""

    kind: ClassVar[str] = "warmup_decode"

    def setup(self, runner: FaultTarget) -> None:
        runner.behaviour.warmup_prefill = False


@register_fault
@dataclass(frozen=True)
class WarmupShort(Fault):
    """Warmup prefills one sequence of ``tokens`` tokens instead of the worst case: the reserve is too small."""

    kind: ClassVar[str] = "warmup_short"
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise UsageError(f"fault {self.kind} needs tokens >= 1")

    def check(self, engine: EngineConfig, scenario: str) -> None:
        if self.tokens > min(engine.max_num_batched_tokens, engine.max_model_len):
            raise UsageError(f"scenario {scenario}: fault {self.kind} warms up {self.tokens} tokens, more than "
                             f"the engine's own warmup; use at most "
                             f"{min(engine.max_num_batched_tokens, engine.max_model_len)}")

    def setup(self, runner: FaultTarget) -> None:
        runner.behaviour.warmup_num_seqs = 1
        runner.behaviour.warmup_seq_len = self.tokens


@register_fault
@dataclass(frozen=True)
class LongPrefill(Fault):
    """A request of ``prompt_tokens`` arrives just before serving step ``at_step``.

    It is the trigger of an understated reserve: its prefill chunks (and, with eager attention, the
    context they attend over) are longer than anything the warmup ran.
    """

    kind: ClassVar[str] = "long_prefill"
    prompt_tokens: int = 0
    output_tokens: int = 1
    at_step: int = 1

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.at_step < 1:
            raise UsageError(f"fault {self.kind} needs prompt_tokens >= 1, output_tokens >= 1 and at_step >= 1")
        if self.rank is not None:
            raise UsageError(f"fault {self.kind} adds a request to the whole engine; leave out rank")

    def check(self, engine: EngineConfig, scenario: str) -> None:
        length = self.prompt_tokens + self.output_tokens
        if length > engine.max_model_len:
            raise UsageError(f"scenario {scenario}: fault {self.kind} adds a request of {length} tokens but "
                             f"max_model_len is {engine.max_model_len}; raise max_model_len")

    @property
    def start_step(self) -> int:
        return self.at_step

    def extra_requests(self) -> tuple[ExtraRequest, ...]:
        return (ExtraRequest(self.at_step, self.prompt_tokens, self.output_tokens),)


@register_fault
@dataclass(frozen=True)
class RankImbalance(Fault):
    """Another process holds ``size_bytes`` on one rank's GPU while the engine starts.

    That rank measures less free memory and sizes fewer KV blocks than the others; nano-vllm
    schedules with rank 0's count on every rank. The process exits at ``release_at_step`` if set.
    """

    kind: ClassVar[str] = "rank_imbalance"
    size_bytes: int = 0
    release_at_step: int | None = None
    name: str = "other-process"

    def __post_init__(self) -> None:
        if self.rank is None or self.size_bytes <= 0:
            raise UsageError(f"fault {self.kind} needs a rank and size_bytes > 0")
        if self.release_at_step is not None and self.release_at_step < 1:
            raise UsageError(f"fault {self.kind}: release_at_step must be a serving step (>= 1)")

    def check(self, engine: EngineConfig, scenario: str) -> None:
        if engine.tensor_parallel_size < 2:
            raise UsageError(f"scenario {scenario}: fault {self.kind} needs tensor_parallel_size >= 2")

    def setup(self, runner: FaultTarget) -> None:
        runner.gpu.take_other_process(self.name, min(self.size_bytes, runner.gpu.driver_free_bytes))

    def before_step(self, runner: FaultTarget, step: int) -> None:
        if step == self.release_at_step:
            runner.gpu.release_other_process(self.name)
