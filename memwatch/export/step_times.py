"""How long an engine's steps take, from its samples' timestamps: how long its silence can be a step in progress.

Why: a sample is written when a step ends, so an engine in a long step (a prefill of a whole batch of tokens)
writes nothing until it ends. A signal that went invalid after a fixed second and a half of silence would drop
such an engine from a router's view in the middle of ordinary work. The rule (docs/fleet.md, docs/routing.md):

* A step is timed when the sample before it said work remained after it (requests waiting, or running beyond
  those that finished in that step): it began when that sample was written, and took until its own sample.
  After an idle spell the start is unknown, and the step is not timed; neither is one after lost records
  (its step number does not follow the previous sample's).
* The step in progress is expected to take as long as the longest of the last :data:`STEP_WINDOW` timed steps;
  while requests wait it may be a prefill of a whole batch (``max_num_batched_tokens``), expected to take that
  many tokens at the seconds per token of the largest timed prefill among them.
* Never more than :data:`STEP_GRACE_FACTOR` times the longest timed step, so an engine that hangs goes invalid
  within that, however long a prefill the estimate would allow.
"""

from __future__ import annotations

from collections import deque

STEP_WINDOW = 64
"""Timed steps kept: the recent ones, so a run's one long stall does not widen the grace for good."""
STEP_GRACE_FACTOR = 4
"""The step in progress is never expected to take more than this many times the longest recent step."""
_PREFILL = 1
"""The ring's step kind of a prefill."""


class StepTimes:
    """The recent steps of one rank, fed its samples that carry a load, in the order they were written."""

    def __init__(self) -> None:
        self._steps: deque[tuple[float, int]] = deque(maxlen=STEP_WINDOW)
        """(seconds, prefill tokens; 0 for any other step) of the recent timed steps."""
        self._last: tuple[int, int, bool] | None = None
        """(step number, ``ts_ns``, whether work remained) of the last sample taken."""

    def take(self, step: int, ts_ns: int, kind: int, tokens: int, busy: bool) -> None:
        """One step's sample: its number, timestamp, step kind code and tokens, and whether work remained."""
        last, self._last = self._last, (step, ts_ns, busy)
        if last is None or not last[2] or step != last[0] + 1 or ts_ns <= last[1]:
            return
        self._steps.append(((ts_ns - last[1]) / 1e9, tokens if kind == _PREFILL and tokens > 0 else 0))

    def expected_s(self, waiting: int | None, batch_tokens: int | None) -> float:
        """Seconds the step in progress is expected to take (0 with no step timed yet)."""
        if not self._steps:
            return 0.0
        longest = max(seconds for seconds, _ in self._steps)
        expected = longest
        prefills = [(tokens, seconds) for seconds, tokens in self._steps if tokens > 0]
        if waiting and batch_tokens and prefills:
            tokens, seconds = max(prefills)
            expected = max(expected, batch_tokens * seconds / tokens)
        return min(expected, STEP_GRACE_FACTOR * longest)
