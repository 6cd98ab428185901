"""A KV cache that is full while requests get preempted: a capacity and latency problem, not an OOM.

When the KV cache runs out, engines preempt running requests and recompute them later; nothing
crashes, but throughput and latency suffer. ``kv_pressure`` is raised when at least
``kv_pressure_usage`` of the blocks are in use and at least ``kv_pressure_min_preemptions``
preemptions happened within the last ``kv_pressure_window_steps`` steps; it re-arms after
``rearm_steps`` samples with no preemption in the window.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from memwatch.detectors.base import Detector, Episode, make_flag
from memwatch.detectors.batch import CLEAR, FIRE, NOT_CLEAR, Plan, apply_episode, episode_plan
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.wording import format_count
from memwatch.flags import KV_PRESSURE, WARNING, Flag
from memwatch.ledger import LedgerTerms
from memwatch.records import Event, Sample

if TYPE_CHECKING:
    from memwatch.detectors.batch import Columns


class KvPressureDetector(Detector):
    """``kv_pressure`` for one rank."""

    __slots__ = ("_block_bytes", "_episode", "_min_preemptions", "_recent", "_recent_count", "_total",
                 "_usage", "_window")

    def __init__(self, config: DetectorConfig, block_bytes: int | None) -> None:
        self._usage = config.kv_pressure_usage
        self._window = config.kv_pressure_window_steps
        self._min_preemptions = config.kv_pressure_min_preemptions
        self._episode = Episode(config.rearm_steps)
        self._block_bytes = block_bytes
        self._recent: deque[tuple[int, int]] = deque()
        self._recent_count = 0
        self._total = 0

    def on_event(self, event: Event) -> None:
        if event.kind != "preemption":
            return
        count = event.data.get("count", 1) if isinstance(event.data, dict) else 1
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            count = 1
        self._recent.append((event.step, count))
        self._recent_count += count
        self._total += count

    def plan(self, batch: Columns) -> Plan:
        np, recent = batch.np, self._recent
        if not recent:
            counts = np.zeros(batch.n, dtype=np.int64)
            dropped = 0
        else:
            # Preemptions leave the window from the oldest on, once a sample's step is past them; what has left
            # stays gone, so after sample i everything up to the furthest step seen so far has left.
            oldest_kept = np.maximum.accumulate(batch.step - self._window)
            steps = np.maximum.accumulate(np.array([step for step, _ in recent], dtype=np.int64))
            left = np.searchsorted(steps, oldest_kept, side="right")
            leaving = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum([count for _, count in recent])))
            counts = self._recent_count - leaving[left]
            dropped = int(left[-1])
        used, total = batch.kv_used, batch.kv_total
        full = (used >= 0) & (total > 0) & (used >= total * self._usage)
        actions = np.where(counts == 0, CLEAR, np.where(full & (counts >= self._min_preemptions), FIRE, NOT_CLEAR))
        episode = episode_plan(np, self._episode, actions)
        if isinstance(episode, int):
            return episode

        def commit() -> None:
            for _ in range(dropped):
                self._recent_count -= recent.popleft()[1]
            apply_episode(self._episode, episode)

        return commit

    def observe(self, sample: Sample, terms: LedgerTerms) -> Flag | None:
        recent = self._recent
        oldest_kept = sample.step - self._window
        while recent and recent[0][0] <= oldest_kept:
            self._recent_count -= recent.popleft()[1]
        used, total = sample.kv_blocks_used, sample.kv_blocks_total
        if self._recent_count == 0:
            self._episode.settle(True)
            return None
        full = used is not None and total and used >= total * self._usage
        if not full or self._recent_count < self._min_preemptions:
            self._episode.settle(False)
            return None
        if not self._episode.fire():
            return None
        block_bytes = self._block_bytes
        return make_flag(
            sample, KV_PRESSURE, WARNING,
            f"KV cache {used / total:.1%} full ({format_count(used)} of {format_count(total)} blocks) with "
            f"{format_count(self._recent_count)} preemptions in the last {format_count(self._window)} steps: "
            f"requests are recomputed (latency and throughput), which is not an out-of-memory risk",
            {"kv_blocks_used": used, "kv_blocks_total": total,
             "kv_used_bytes": None if block_bytes is None else used * block_bytes,
             "kv_total_bytes": None if block_bytes is None else total * block_bytes,
             "preemptions_in_window": self._recent_count, "window_steps": self._window,
             "preemptions_total": self._total},
        )
