"""What every per-rank detector shares: the streaming interface and once-per-episode hysteresis."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from memwatch.flags import Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Event, Sample

if TYPE_CHECKING:
    from memwatch.detectors.batch import Columns, Plan


class Detector(ABC):
    """A streaming rule over one rank's serving samples.

    The detector set calls :meth:`start` on the first serving sample (the baseline every drift is
    judged against), then :meth:`observe` on it and every later sample, and :meth:`on_event` for the
    rank's events. ``observe`` returns ``None`` on the common path, so that path allocates nothing.
    """

    __slots__ = ()

    def start(self, sample: Sample, terms: LedgerTerms) -> None:  # noqa: B027 (optional hook)
        """Take the serving baseline."""

    @abstractmethod
    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        """Judge one serving sample; a flag when an episode starts, else ``None``."""

    def on_event(self, event: Event) -> None:  # noqa: B027 (optional hook)
        """Take in an event of this rank (most detectors need none)."""

    def plan(self, batch: Columns) -> Plan:
        """For a batch of serving samples (:mod:`memwatch.detectors.batch`): a function that leaves this
        detector as :meth:`observe` on each sample would; or, where the batch raises a flag here or holds
        what only :meth:`observe` handles, the number of leading samples before that (a plan of just those
        would be a function)."""
        return 0


class Episode:
    """Raise once per episode; re-arm after ``rearm_steps`` consecutive clear samples.

    A sample is *firing* (the condition holds), *clear* (it does not, with margin) or in between;
    an in-between sample restarts the count towards re-arming.
    """

    __slots__ = ("_clear_run", "_rearm_steps", "active")

    def __init__(self, rearm_steps: int) -> None:
        self._rearm_steps = rearm_steps
        self._clear_run = 0
        self.active = False

    def fire(self) -> bool:
        """The condition holds; True when this starts a new episode (raise the flag now)."""
        self._clear_run = 0
        if self.active:
            return False
        self.active = True
        return True

    def settle(self, clear: bool) -> None:
        """The condition does not hold; ``clear`` says whether it is off by the margin."""
        if not self.active:
            return
        if not clear:
            self._clear_run = 0
            return
        self._clear_run += 1
        if self._clear_run >= self._rearm_steps:
            self.active = False


def make_flag(sample: Sample | Event, kind: str, severity: str, message: str, data: dict[str, Any]) -> Flag:
    """A flag about the rank and step of ``sample``."""
    return Flag(sample.run_id, sample.rank, sample.step, sample.ts_ns, kind, severity, message, data)
