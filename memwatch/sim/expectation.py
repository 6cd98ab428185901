"""What a scenario expects the detectors to raise: the ``[expect]`` table of a scenario file.

The scorecard (:mod:`memwatch.sim.scorecard`) replays each shipped scenario and compares what was
raised with this, so a scenario states its own purpose: a clean one expects no flags, a fault one
the kinds its fault should make visible, and whether it should end in an out-of-memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memwatch.errors import UsageError
from memwatch.flags import FLAG_KINDS

RUN_STATUSES = ("ok", "oom", "crashed", "error")


@dataclass(frozen=True)
class Expectation:
    """``flags``: the distinct kinds the replay must raise, no more and no fewer; ``status``: how the
    simulated run ends; ``gradual``: an OOM that builds up over many steps, so ``oom_risk`` must warn
    early enough (the scorecard's lead-time rule)."""

    flags: tuple[str, ...] | list[str] = ()
    status: str = "ok"
    gradual: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "flags", tuple(self.flags))
        unknown = [kind for kind in self.flags if kind not in FLAG_KINDS]
        if unknown:
            raise UsageError(f"[expect] flags: unknown flag kind {unknown[0]!r}; known kinds: {', '.join(FLAG_KINDS)}")
        if len(set(self.flags)) != len(self.flags):
            raise UsageError("[expect] flags: list each kind once")
        if self.status not in RUN_STATUSES:
            raise UsageError(f"[expect] status must be one of {', '.join(RUN_STATUSES)}, got {self.status!r}")
        if self.gradual and self.status not in ("oom", "crashed"):
            raise UsageError("[expect] gradual = true describes running out of memory; set status = \"oom\" "
                             "or \"crashed\"")

    @property
    def clean(self) -> bool:
        """A clean scenario: nothing should be raised and the run should end well."""
        return not self.flags and self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {"flags": list(self.flags), "status": self.status, "gradual": self.gradual}
