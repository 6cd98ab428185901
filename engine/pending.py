"""Before the runtime directory exists: a run's records kept in memory until the sidecar makes it.

Where the sidecar is someone else's (``MEMWATCH_SPAWN=0`` and ``MEMWATCH_RUNTIME_DIR`` set: a sidecar
container, a node agent), the runtime directory is the sidecar's to create, as a shared group directory.
Containers start in any order (an ordinary sidecar container before Kubernetes 1.29 is not started
first), and an engine that made the directory itself would make it private to its own uid, which the
sidecar then refuses for as long as the pod lives. So the engine never creates it there; it waits:

* every record is kept in memory: samples up to :data:`KEPT_SAMPLES` (the first ones: the load,
  warm-up and KV sizing that a late ring would miss), events (phases, the KV sizing, the run's end) up
  to :data:`KEPT_EVENT_SLOTS` records more. A sample past the bound is counted, not kept;
* a Monitor call (a step, an event) looks for the directory, one ``stat``, at most once every
  :data:`LOOK_EVERY_S` seconds: in between, a step costs one clock read and a compare more;
* once the directory is there (and acceptable, as any runtime directory), the ring is created and the
  kept records are written into it first, in order, then one ``samples_lost`` event for the samples
  not kept (``count``, ``from_ts_ns``, ``to_ts_ns``). From then on the step is the usual one.

So a run whose sidecar comes up within a few minutes of the engine (at 100 steps a second,
:data:`KEPT_SAMPLES` lasts 5 minutes) is stored whole. Closing the Monitor looks once more; a
directory that never came means nothing was stored, which the engine's one warning line said
(:mod:`.lifecycle`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .probes.base import UNKNOWN, Probe
from .ring_format import SAMPLE_PEAK_IS_STEP, STEP_KIND_CODES, event_slots, sample_slot
from .runtime import ensure_runtime_dir
from .stepper import StepPath

KEPT_SAMPLES = 32768
"""Samples kept while the ring cannot be created yet: half a default ring (4 MiB of memory at most)."""
KEPT_EVENT_SLOTS = 4096
"""Event records kept meanwhile (an event is one record per 96 bytes of its JSON)."""
LOOK_EVERY_S = 1.0


def runtime_directory(given: str | os.PathLike[str] | None, spawn_sidecar: bool | None) -> tuple[Path, bool]:
    """The runtime directory, and whether it is the sidecar's to create and not there yet.

    With ``MEMWATCH_SPAWN=0`` and ``MEMWATCH_RUNTIME_DIR`` set, a sidecar of someone else's serves that
    directory and makes it (shared, mode 3770): the engine never creates it (.pending). Otherwise it is
    created private when missing, as always; an existing one is judged the same way in both cases.
    """
    named = os.environ.get("MEMWATCH_RUNTIME_DIR")
    theirs = (bool(named) and spawn_sidecar is not True and os.environ.get("MEMWATCH_SPAWN") == "0"
              and (given is None or Path(given) == Path(named)))
    if theirs:
        directory = Path(named)  # type: ignore[arg-type]
        try:
            os.lstat(directory)
        except FileNotFoundError:
            return directory, True
    return ensure_runtime_dir(given), False


class PendingRecords:
    """The records of a run whose ring does not exist yet, in order, bounded (see the module's docstring)."""

    def __init__(self, samples: int | None = None, event_slots: int | None = None) -> None:
        self.records: list[list[bytes]] = []
        self._samples_left = KEPT_SAMPLES if samples is None else samples
        self._event_slots_left = KEPT_EVENT_SLOTS if event_slots is None else event_slots
        self.dropped = 0
        self.dropped_from_ns: int | None = None
        self.dropped_to_ns: int | None = None

    def write_sample(self, *fields: int) -> None:
        """Keep one sample (fields as :func:`.ring_format.sample_slot` takes them), or count it when the bound is
        reached."""
        if self._samples_left <= 0:
            self._drop(fields[1])
            return
        self._samples_left -= 1
        self.records.append([sample_slot(*fields)])

    def write_event(self, step: int, ts_ns: int, kind: str, data: dict[str, Any]) -> None:
        slots = event_slots(step, ts_ns, kind, data)
        if len(slots) > self._event_slots_left:
            self._drop(ts_ns)
            return
        self._event_slots_left -= len(slots)
        self.records.append(slots)

    def _drop(self, ts_ns: int) -> None:
        self.dropped += 1
        if self.dropped_from_ns is None:
            self.dropped_from_ns = ts_ns
        self.dropped_to_ns = ts_ns

    def lost_event(self) -> dict[str, Any] | None:
        """The ``samples_lost`` event's data for what was not kept, or None when everything was."""
        if not self.dropped:
            return None
        return {"count": self.dropped, "from_ts_ns": self.dropped_from_ns, "to_ts_ns": self.dropped_to_ns,
                "why": "the runtime directory did not exist yet"}

    def close(self) -> None:
        """Nothing to close: the records go with the Monitor."""


def build_pending_step(pending: PendingRecords, probe: Probe, clock: Callable[[], int], *,
                       on_fault: Callable[[BaseException], None], look: Callable[[], None]) -> StepPath:
    """A step that keeps its sample in ``pending`` and calls ``look()`` (which throttles itself) after it."""
    codes, read_plain, read_and_reset = STEP_KIND_CODES, probe.read_step, probe.read_step_and_reset
    live, count, phase, flags, read = True, 0, 0, 0, read_plain

    def step(kind: str | None = None, num_seqs: int | None = UNKNOWN, num_tokens: int | None = UNKNOWN,
             kv_blocks_used: int | None = UNKNOWN, kv_blocks_total: int | None = UNKNOWN,
             requests_running: int | None = UNKNOWN, requests_waiting: int | None = UNKNOWN,
             kv_blocks_needed: int | None = UNKNOWN) -> None:
        nonlocal count
        if not live:
            return
        try:
            reading = read()
            count += 1
            seqs, tokens, used, total, *load = (
                UNKNOWN if n is None else n for n in (num_seqs, num_tokens, kv_blocks_used, kv_blocks_total,
                                                       requests_running, requests_waiting, kv_blocks_needed))
            pending.write_sample(count, clock(), phase, codes.get(kind, 0), flags, *reading[:5], tokens, used,
                                 total, seqs, *reading[5:], *load)
        except Exception as exc:
            on_fault(exc)
            return
        look()

    def set_phase(code: int) -> None:
        nonlocal phase
        phase = code

    def per_step_peak(on: bool) -> None:
        nonlocal read, flags
        read, flags = (read_and_reset, SAMPLE_PEAK_IS_STEP) if on else (read_plain, 0)

    def stop() -> None:
        nonlocal live
        live = False

    def steps() -> int:
        return count

    return StepPath(step, set_phase, per_step_peak, stop, steps)


class Throttle:
    """True at most once every ``seconds`` (a monotonic clock read and a compare otherwise)."""

    def __init__(self, seconds: float = LOOK_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._every, self._clock = seconds, clock
        self._next = clock() + seconds

    def due(self) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self._every
        return True
