"""Faults a scenario can inject, and the registry that maps a scenario's ``kind`` to its class.

A fault is a frozen dataclass whose fields are its scenario parameters. It acts on one rank through
the narrow :class:`FaultTarget` interface (a rank's device and startup knobs; the simulator's
``RankRunner`` provides it) with two hooks: :meth:`Fault.setup` once before startup (it may change
``target.behaviour`` or the device) and :meth:`Fault.before_step` before every serving step. A fault
may also add requests to the workload (:meth:`Fault.extra_requests`) and check itself against the
engine's settings (:meth:`Fault.check`). This module knows nothing of scenarios or runners, so the
imports run one way: ``faults`` <- ``fault_kinds`` <- ``scenario`` and ``runner``. New kinds subclass :class:`Fault`
and decorate themselves with :func:`register_fault`; the scenario loader then accepts them by name.

This module holds the base, the registry and ``other_process`` (the first kind, kept here so that
``ExternalProcess`` stays importable from where it always was); the other shipped kinds live in
:mod:`memwatch.sim.fault_kinds` and register themselves when it is imported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar

from memwatch.errors import UsageError
from memwatch.sim.config import EngineConfig, StartupBehaviour
from memwatch.sim.gpu import VirtualGPU


class FaultTarget(Protocol):
    """What a fault may touch on one rank: its index, its device and its startup knobs."""

    rank: int
    gpu: VirtualGPU
    behaviour: StartupBehaviour

FAULT_KINDS: dict[str, type[Fault]] = {}
"""Every accepted ``kind``, documented names and aliases alike, to its class."""

F = TypeVar("F", bound="type[Fault]")


def register_fault(cls: F) -> F:
    """Class decorator: make a fault kind available to scenarios under ``cls.kind`` and its aliases."""
    for name in (cls.kind, *cls.aliases):
        if not name or name in FAULT_KINDS:
            raise ValueError(f"fault kind {name!r} is empty or registered twice")
        FAULT_KINDS[name] = cls
    return cls


def documented_fault_kinds() -> list[str]:
    """The documented kind names (aliases left out), sorted."""
    return sorted({cls.kind for cls in FAULT_KINDS.values()})


class ExtraRequest(NamedTuple):
    """A request a fault adds to the workload; it arrives just before serving step ``at_step`` runs."""

    at_step: int
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Fault:
    """Base of every fault. ``rank`` limits it to one rank; ``None`` applies it to all."""

    kind: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    rank: int | None = None

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def check(self, engine: EngineConfig, scenario: str) -> None:
        """Raise :class:`UsageError` when this fault cannot apply to scenario ``scenario``'s engine (on load)."""

    def setup(self, runner: FaultTarget) -> None:
        """Called once on each rank it applies to, before the engine starts."""

    def before_step(self, runner: FaultTarget, step: int) -> None:
        """Called on each rank it applies to before serving step ``step`` (1-based) runs its forward."""

    def requests_finished(self, runner: FaultTarget, step: int, count: int) -> None:
        """Called on each rank it applies to when ``count`` requests finished in serving step ``step``."""

    def extra_requests(self) -> tuple[ExtraRequest, ...]:
        """Requests this fault adds to the workload (the engine schedules them; ranks do not matter)."""
        return ()

    @property
    def start_step(self) -> int:
        """The serving step from which the fault acts (0: from startup). Nothing it causes can show earlier,
        so the scorecard holds a forecast made before it to be a false alarm."""
        return 0

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


@register_fault
@dataclass(frozen=True)
class OtherProcess(Fault):
    """Another process takes ``size_bytes`` of the device at ``at_step`` (0: before startup).

    Like a greedy process, it takes what it asks for or, when less is free, everything that is free.
    It gives it all back at ``release_at_step`` when one is set. ``external_process`` is an alias.
    """

    kind: ClassVar[str] = "other_process"
    aliases: ClassVar[tuple[str, ...]] = ("external_process",)
    size_bytes: int = 0
    at_step: int = 0
    release_at_step: int | None = None
    name: str = "other-process"

    def __post_init__(self) -> None:
        if self.size_bytes <= 0 or self.at_step < 0:
            raise UsageError(f"fault {self.kind} needs size_bytes > 0 and at_step >= 0")
        if self.release_at_step is not None and self.release_at_step <= self.at_step:
            raise UsageError(f"fault {self.kind}: release_at_step must come after at_step")

    @property
    def start_step(self) -> int:
        return self.at_step

    def setup(self, runner: FaultTarget) -> None:
        if self.at_step == 0:
            self._take(runner)

    def before_step(self, runner: FaultTarget, step: int) -> None:
        if step == self.at_step:
            self._take(runner)
        elif step == self.release_at_step:
            runner.gpu.release_other_process(self.name)

    def _take(self, runner: FaultTarget) -> None:
        runner.gpu.take_other_process(self.name, min(self.size_bytes, runner.gpu.driver_free_bytes))


ExternalProcess = OtherProcess
"""The kind's first name, still accepted in scenario files as ``external_process``."""
