"""How a Monitor gets its ring: created at once in its runtime directory, or waited for.

Where the runtime directory is the sidecar's and not there yet (:mod:`.pending`), the Monitor starts with a
step that keeps its records in memory and now and then looks for the directory; the look that finds it
creates the ring, writes the kept records into it first and puts the ring's own step (:mod:`.stepper`) in
place. Why a module of its own: this is the one part of the Monitor that replaces its writer and its step
while the engine runs; everything else in :mod:`.monitor` only calls them. :class:`RingOpening` is the
Monitor's base class, so the step it puts in place is the instance's own attribute: no method to bind.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .pending import PendingRecords, Throttle, build_pending_step
from .probes.base import Probe
from .ring import RingWriter
from .runtime import judge_runtime_dir, ring_mode, ring_path
from .stepper import StepPath, build_step


class RingOpening:
    """The ring-making half of :class:`~.monitor.Monitor`; the names annotated below are the Monitor's own."""

    run_id: str
    rank: int
    world_size: int
    ring_path: Path | None
    probe: Probe
    step: Callable[..., None]
    _clock: Callable[[], int]
    _phase: int
    _per_step: bool
    _meta: dict[str, Any]
    _capacity: int
    _directory: Path | None
    _writer: RingWriter | None
    _path: StepPath | None
    _pending: PendingRecords | None
    _look: Throttle
    _attaching: threading.Lock
    _disable: Callable[[BaseException], None]

    def _start_ring(self, directory: Path, theirs: bool) -> int:
        """The ring in ``directory``, or, where the directory is the sidecar's and not there yet, the step that keeps
        records until it is (never ours to create: .pending); the ring's file mode."""
        if theirs:
            self._pending = PendingRecords()
            self._writer = self._pending  # type: ignore[assignment]  # the same two writing methods
            self._path = build_pending_step(self._pending, self.probe, self._clock, on_fault=self._disable,
                                            look=self._look_for_directory)
            self.step = self._path.step  # type: ignore[method-assign]
            return 0o640
        return self._open_ring(directory)

    def _open_ring(self, directory: Path) -> int:
        """Create the ring in ``directory`` and the step that writes it; its file mode. Records kept while the
        directory did not exist go first (.pending)."""
        self.ring_path = ring_path(directory, self.run_id, self.rank)
        mode = ring_mode(directory)
        writer = RingWriter(
            self.ring_path, run_id=self.run_id, rank=self.rank, world_size=self.world_size,
            meta=self._meta, capacity=self._capacity, mode=mode,
        )
        pending, waiting = self._pending, self._path
        if pending is not None:
            for records in pending.records:
                writer.write_slots(records)
            lost = pending.lost_event()
            if lost is not None:
                writer.write_event(waiting.steps(), self._clock(), "samples_lost", lost)
        path = build_step(writer, self.probe, self._clock, on_fault=self._disable,
                          start=waiting.steps() if waiting is not None else 0)
        path.set_phase(self._phase)
        path.per_step_peak(self._per_step)
        self._writer, self._path, self._pending = writer, path, None
        self.step = path.step  # type: ignore[method-assign]  # the instance's own: no method to bind
        if waiting is not None:
            waiting.stop()
        return mode

    def _look_for_directory(self, now: bool = False) -> None:
        """While the ring waits for its directory: at most once a second (or ``now``), one ``stat`` of it."""
        if self._pending is None or not (now or self._look.due()):
            return
        if not self._attaching.acquire(blocking=False):
            return  # another thread is creating the ring
        try:
            if self._pending is None or self._directory is None:
                return
            try:
                info = os.lstat(self._directory)
            except FileNotFoundError:
                return
            judge_runtime_dir(info, self._directory)
            self._open_ring(self._directory)
        except Exception as exc:
            self._disable(exc)
        finally:
            self._attaching.release()
