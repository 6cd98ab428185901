"""The per-step hot path: ``Monitor.step`` built as one closure over the ring, the probe and the clock.

Why a closure: on this path each attribute lookup, method call or lock costs tens of nanoseconds, as
much as the work itself. A closure keeps its state in cells, the cheapest state Python has, and packs
the sample straight into its ring slot; ``bench/bench_plugin.py`` measures what that leaves above the
floor. The rare cases leave the fast path for the ring writer's own :meth:`~.ring.RingWriter.write_sample`:
a count given as ``None``, a step kind the ring has no code for, a value that does not pack, the ring
held by another thread's writer (the step then queues its sample and returns: it never waits), and records
queued before the step, which go first. A record queued while a step held the ring is written by the next
write to it (the next step, an event, or closing), so the step does not look at the queue a second time.

The step number counts steps exactly when one thread steps, which is how engines call it; steps from
several threads at once are each recorded whole, but two of them may carry the same number.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .probes.base import UNKNOWN, Probe
from .ring import RingWriter
from .ring_format import (
    _SAMPLE_WRITE,
    HEADER_SIZE,
    PUBLISHED_WORD,
    RECORD_SIZE,
    SAMPLE_HAS_LOAD,
    SAMPLE_PEAK_IS_STEP,
    STEP_KIND_CODES,
    TYPE_SAMPLE,
)


class StepPath(NamedTuple):
    """The step and the few switches the Monitor turns on it."""

    step: Callable[..., None]
    """``step(kind=None, num_seqs=-1, num_tokens=-1, kv_blocks_used=-1, kv_blocks_total=-1, requests_running=-1,
    requests_waiting=-1, kv_blocks_needed=-1)``; -1 or None: unknown."""
    set_phase: Callable[[int], None]
    per_step_peak: Callable[[bool], None]
    """On: each step reads the probe and resets its peak in one call, and marks the sample's peak its own."""
    stop: Callable[[], None]
    """Turn the step into a no-op (the Monitor is off or closed)."""
    steps: Callable[[], int]
    """Steps recorded so far."""


def build_step(writer: RingWriter, probe: Probe, clock: Callable[[], int] = time.time_ns, *,
               on_fault: Callable[[BaseException], None], start: int = 0) -> StepPath:
    """The step for ``writer``'s ring; ``on_fault(exc)`` is called, once the step has caught ``exc``, to turn it off.
    ``start``: steps already counted (before the ring existed: :mod:`.pending`)."""
    ring, mask, cursor, published, waiting = writer.hot_path()
    take, give, pack, codes = cursor.pop, cursor.append, _SAMPLE_WRITE.pack_into, STEP_KIND_CODES
    read_plain, read_and_reset = probe.read_step, probe.read_step_and_reset
    live, count, phase, flags, read = True, start, 0, SAMPLE_HAS_LOAD, read_plain

    def step(kind: str | None = None, num_seqs: int | None = UNKNOWN, num_tokens: int | None = UNKNOWN,
             kv_blocks_used: int | None = UNKNOWN, kv_blocks_total: int | None = UNKNOWN,
             requests_running: int | None = UNKNOWN, requests_waiting: int | None = UNKNOWN,
             kv_blocks_needed: int | None = UNKNOWN) -> None:
        nonlocal count
        if not live:
            return
        try:
            allocated, peak, reserved, used, free, segments, active, pinned, retries, ooms = read()
        except Exception as exc:
            on_fault(exc)
            return
        try:
            code = codes[kind]
            seq = take()  # IndexError: another writer holds the ring
            if waiting:  # records queued before this step go first, in order: the writer's path does that
                give(seq)
                raise IndexError
        except (KeyError, TypeError, IndexError):
            count += 1
            slowly(count, kind, (num_seqs, num_tokens, kv_blocks_used, kv_blocks_total, requests_running,
                                 requests_waiting, kv_blocks_needed),
                   (allocated, peak, reserved, used, free, segments, active, pinned, retries, ooms))
            return
        count += 1
        try:
            pack(ring, HEADER_SIZE + (seq & mask) * RECORD_SIZE, seq, TYPE_SAMPLE, flags, phase, code,
                 requests_running, count, clock(), allocated, peak, reserved, used, free, num_tokens, kv_blocks_used,
                 kv_blocks_total, num_seqs, segments, active, pinned, retries, ooms, requests_waiting,
                 kv_blocks_needed)
            seq += 1
            published[PUBLISHED_WORD] = seq
        except Exception:  # a None or a value that does not pack: the slow path says which
            give(seq)
            slowly(count, kind, (num_seqs, num_tokens, kv_blocks_used, kv_blocks_total, requests_running,
                                 requests_waiting, kv_blocks_needed),
                   (allocated, peak, reserved, used, free, segments, active, pinned, retries, ooms))
            return
        give(seq)

    def slowly(number: int, kind: Any, counts: tuple[int | None, ...], reading: tuple[int, ...]) -> None:
        """Step ``number`` through the writer's thread-safe path, with ``None`` read as unknown."""
        try:
            num_seqs, num_tokens, kv_used, kv_total, *load = (UNKNOWN if n is None else n for n in counts)
            writer.write_sample(number, clock(), phase, codes.get(kind, 0), flags, *reading[:5], num_tokens,
                                kv_used, kv_total, num_seqs, *reading[5:], *load)
        except Exception as exc:
            on_fault(exc)

    def set_phase(code: int) -> None:
        nonlocal phase
        phase = code

    def per_step_peak(on: bool) -> None:
        nonlocal read, flags
        read, flags = (read_and_reset, SAMPLE_PEAK_IS_STEP | SAMPLE_HAS_LOAD) if on else (read_plain, SAMPLE_HAS_LOAD)

    def stop() -> None:
        nonlocal live
        live = False

    def steps() -> int:
        return count

    return StepPath(step, set_phase, per_step_peak, stop, steps)
