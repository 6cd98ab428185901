"""Faults a scenario can inject, and the registry that maps a scenario's ``kind`` to its class.

A fault is a frozen dataclass whose fields are its scenario parameters. It acts on one rank's runner
(:class:`memwatch.sim.runner.RankRunner`) through two hooks: :meth:`Fault.setup` once before startup
(it may change ``runner.behaviour``, the startup knobs, or the device) and :meth:`Fault.before_step`
before every serving step. New kinds subclass :class:`Fault` and decorate themselves with
:func:`register_fault`; the scenario loader then accepts them by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from memwatch.errors import UsageError

if TYPE_CHECKING:
    from memwatch.sim.runner import RankRunner

FAULT_KINDS: dict[str, type[Fault]] = {}

F = TypeVar("F", bound="type[Fault]")


def register_fault(cls: F) -> F:
    """Class decorator: make a fault kind available to scenarios under ``cls.kind``."""
    if not cls.kind or cls.kind in FAULT_KINDS:
        raise ValueError(f"fault kind {cls.kind!r} is empty or registered twice")
    FAULT_KINDS[cls.kind] = cls
    return cls


@dataclass(frozen=True)
class Fault:
    """Base of every fault. ``rank`` limits it to one rank; ``None`` applies it to all."""

    kind: ClassVar[str] = ""
    rank: int | None = None

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def setup(self, runner: RankRunner) -> None:
        """Called once on each rank it applies to, before the engine starts."""

    def before_step(self, runner: RankRunner, step: int) -> None:
        """Called on each rank it applies to before serving step ``step`` (1-based) runs its forward."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


@register_fault
@dataclass(frozen=True)
class ExternalProcess(Fault):
    """Another process takes ``size_bytes`` of the device at ``at_step`` (0: before startup).

    Like a greedy process, it takes what it asks for or, when less is free, everything that is free.
    It gives it all back at ``release_at_step`` when one is set.
    """

    kind: ClassVar[str] = "external_process"
    size_bytes: int = 0
    at_step: int = 0
    release_at_step: int | None = None
    name: str = "other-process"

    def __post_init__(self) -> None:
        if self.size_bytes <= 0 or self.at_step < 0:
            raise UsageError("fault external_process needs size_bytes > 0 and at_step >= 0")
        if self.release_at_step is not None and self.release_at_step <= self.at_step:
            raise UsageError("fault external_process: release_at_step must come after at_step")

    def setup(self, runner: RankRunner) -> None:
        if self.at_step == 0:
            self._take(runner)

    def before_step(self, runner: RankRunner, step: int) -> None:
        if step == self.at_step:
            self._take(runner)
        elif step == self.release_at_step:
            runner.gpu.release_other_process(self.name)

    def _take(self, runner: RankRunner) -> None:
        runner.gpu.take_other_process(self.name, min(self.size_bytes, runner.gpu.driver_free_bytes))

