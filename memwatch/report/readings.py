"""What a rank's raw readings did, for the post-mortems the ledger cannot give.

Two cases need it. A run that **crashed** (its writer vanished: a signal, a fault, a failed allocation)
ends without an ``oom`` event, so the first thing to say is that, then where it stopped and how the
memory moved in its last window. A rank that **never sized a KV cache** (a plain ``Monitor`` loop)
has no budget, so headroom, residual and OOM margin cannot be known; the allocator and driver terms,
their peaks and their growth can, and are reported from the samples alone.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from memwatch.detectors.detector_set import STARTUP_PHASES
from memwatch.detectors.wording import format_bytes, format_count, format_duration_ns
from memwatch.records import Event, Sample
from memwatch.store.run_figures import nearly_full
from memwatch.store.run_model import CRASHED, WINDOW_STEPS

ENDED_BADLY = {CRASHED: "crashed", "error": "stopped with an error"}
"""Run statuses a post-mortem must lead with, and how they are said."""
CRASH = "crash"
"""The end of a rank that died without an OOM event (its ring never closed), explained like an OOM."""
DETACHED = "detached"
EXITED = "exited"
RUNNING = "running"
"""A stored run's status while any of its ranks has not ended: what is said of it is so far."""
ENDED_UNSEEN = (DETACHED, EXITED)
"""Run statuses whose end memwatch did not see: recording turned off (``attach --detach``, or ``attach --record``
stopped) while the process went on, or a process watched from outside that exited with an unknown code."""

UNSIZED_SENTENCE = ("no KV sizing was recorded (no kv_allocated event), so the budget, headroom, residual and "
                    "OOM margin cannot be known")


def _non_torch(sample: Sample) -> int | None:
    used, reserved = sample.driver_used_bytes, sample.reserved_bytes
    return None if used is None or reserved is None else used - reserved


def _slack(sample: Sample) -> int | None:
    reserved, allocated = sample.reserved_bytes, sample.allocated_bytes
    return None if reserved is None or allocated is None else reserved - allocated


READINGS: tuple[tuple[str, str], ...] = (
    ("driver_free_bytes", "free memory"),
    ("non_torch_bytes", "non-PyTorch"),
    ("cache_slack_bytes", "cache slack"),
    ("allocated_bytes", "allocated"),
)


def _values(sample: Sample) -> dict[str, int | None]:
    return {"driver_free_bytes": sample.driver_free_bytes, "non_torch_bytes": _non_torch(sample),
            "cache_slack_bytes": _slack(sample), "allocated_bytes": sample.allocated_bytes}


@dataclass(frozen=True)
class ReadingsWindow:
    """How the raw readings moved from the first to the last sample of a window."""

    from_step: int
    to_step: int
    seconds: float
    start: dict[str, int | None]
    end: dict[str, int | None]

    def sentence(self, what: str) -> str:
        parts = []
        for key, label in READINGS:
            start, end = self.start[key], self.end[key]
            if start is None or end is None:
                parts.append(f"{label} unknown")
            elif key == "driver_free_bytes":
                parts.append(f"{label} {format_bytes(start)} -> {format_bytes(end)}")
            else:
                parts.append(f"{label} {'+' if end >= start else '-'}{format_bytes(abs(end - start))}")
        return (f"{what}, steps {format_count(self.from_step)} to {format_count(self.to_step)} "
                f"({format_duration_ns(round(self.seconds * 1e9))}): {', '.join(parts)}.")


@dataclass
class RankReadings:
    """One rank's samples folded into what a post-mortem can say without a ledger."""

    rank: int
    samples: int = 0
    first_serving: Sample | None = None
    last: Sample | None = None
    max_peak_bytes: int | None = None
    max_reserved_bytes: int | None = None
    max_driver_used_bytes: int | None = None
    total_bytes: int | None = None
    window: deque[Sample] = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))
    window_samples: int = 0
    """How many samples :meth:`last_window` spanned."""
    device_note: str | None = None
    """Why the rank has no allocator or driver columns at all (its device is a CPU), said once instead of them."""

    def add(self, sample: Sample, startup: bool) -> None:
        self.samples += 1
        self.last = sample
        self.window.append(sample)
        if self.first_serving is None and not startup:
            self.first_serving = sample
        self.max_peak_bytes = _max(self.max_peak_bytes, sample.peak_bytes)
        self.max_reserved_bytes = _max(self.max_reserved_bytes, sample.reserved_bytes)
        self.max_driver_used_bytes = _max(self.max_driver_used_bytes, sample.driver_used_bytes)
        if sample.driver_used_bytes is not None and sample.driver_free_bytes is not None:
            self.total_bytes = sample.driver_used_bytes + sample.driver_free_bytes

    def last_window(self) -> ReadingsWindow | None:
        """The last samples; when the rank was serving at the end, only its serving samples."""
        if not self.window:
            return None
        window = list(self.window)
        if self.first_serving is not None and window[-1].phase not in STARTUP_PHASES:
            window = [s for s in window if s.phase not in STARTUP_PHASES] or window
        self.window_samples = len(window)
        start, end = window[0], window[-1]
        return ReadingsWindow(start.step, end.step, (end.ts_ns - start.ts_ns) / 1e9, _values(start), _values(end))

    def since_serving(self) -> ReadingsWindow | None:
        if self.first_serving is None or self.last is None:
            return None
        start, end = self.first_serving, self.last
        return ReadingsWindow(start.step, end.step, (end.ts_ns - start.ts_ns) / 1e9, _values(start), _values(end))

    def unsized_sentences(self) -> list[str]:
        """What can be said of a rank without a KV sizing, and what cannot."""
        if self.device_note is not None:
            return [f"rank {self.rank}: {self.device_note}."]
        sentences = [f"rank {self.rank}: {UNSIZED_SENTENCE}."]
        if self.last is None:
            return sentences
        device = "" if self.total_bytes is None else f" of {format_bytes(self.total_bytes)}"
        sentences.append(
            f"rank {self.rank} recorded {format_count(self.samples)} samples up to step "
            f"{format_count(self.last.step)}: allocator peak {_size(self.max_peak_bytes)}, "
            f"reserved at most {_size(self.max_reserved_bytes)}, driver used at most "
            f"{_size(self.max_driver_used_bytes)}{device}; at the end non-PyTorch {_size(_non_torch(self.last))}, "
            f"cache slack {_size(_slack(self.last))}.")
        growth = self.since_serving()
        if growth is not None and growth.to_step != growth.from_step:
            sentences.append(growth.sentence(f"rank {self.rank} since its first serving sample"))
        return sentences

    def to_dict(self) -> dict[str, Any]:
        last = self.last
        window, growth = self.last_window(), self.since_serving()
        return {
            "rank": self.rank, "samples": self.samples,
            "last_step": None if last is None else last.step, "last_ts_ns": None if last is None else last.ts_ns,
            "last_phase": None if last is None else last.phase,
            "max_peak_bytes": self.max_peak_bytes, "max_reserved_bytes": self.max_reserved_bytes,
            "max_driver_used_bytes": self.max_driver_used_bytes, "total_bytes": self.total_bytes,
            "last": None if last is None else _values(last),
            "last_window": None if window is None else window.__dict__,
            "since_serving": None if growth is None else growth.__dict__,
        }


def crash_sentences(status: str, ranks: list[RankReadings], started_ns: int | None,
                    explained: frozenset[int] = frozenset(), windowed: frozenset[int] = frozenset()) -> list[str]:
    """The lead of a post-mortem for a run that ended badly: where it stopped and what the readings did.

    Ranks in ``explained`` have an account of their own that says their free memory, and those in
    ``windowed`` one that says their last window too: neither is said twice.
    """
    said = ENDED_BADLY[status]
    last = max((r.last for r in ranks if r.last is not None), key=lambda s: s.ts_ns, default=None)
    if last is None:
        return [f"the run {said} before recording any sample."]
    how = ": its process ended without recording how" if status == CRASHED else ""
    elapsed = None if started_ns is None else last.ts_ns - started_ns
    after = "" if elapsed is None or elapsed <= 0 else f", {format_duration_ns(elapsed)} after it started"
    sentences = [f"the run {said}{how}; its last record is rank {last.rank} step {format_count(last.step)}"
                 f"{'' if last.phase is None else f' ({last.phase})'} at {format_time(last.ts_ns)}{after}."]
    full = [rank.rank for rank in ranks if rank.last is not None and rank.last.driver_free_bytes is not None
            and rank.total_bytes and nearly_full(rank.last.driver_free_bytes, rank.total_bytes)]
    for rank in ranks:
        window = rank.last_window()
        if window is None:
            continue
        if rank.rank not in windowed:
            sentences.append(window.sentence(f"rank {rank.rank}'s last {format_count(rank.window_samples)} samples"))
        free = window.end["driver_free_bytes"]
        if free is not None and rank.total_bytes and rank.rank not in explained:
            if nearly_full(free, rank.total_bytes):
                left = "no memory free" if free == 0 else f"only {format_bytes(free)} free"
                sentences.append(f"rank {rank.rank} had {left} at its last sample: a failed GPU allocation is "
                                 "the likely cause.")
            elif full:
                # Ranks of one engine stop together: one that still had room went down with the one that had none.
                sentences.append(f"rank {rank.rank} still had {format_bytes(free)} free at its last sample: it "
                                 f"likely stopped with rank {full[0]}, whose device was nearly full.")
            else:
                sentences.append(f"rank {rank.rank} still had {format_bytes(free)} free at its last sample: the "
                                 "readings do not point to GPU memory (look at how the process ended: a signal, "
                                 "the host's OOM killer, a fault).")
    return sentences


def unseen_end_sentence(status: str, ranks: list[RankReadings]) -> str:
    """The lead of a post-mortem for a run whose end was not seen (:data:`ENDED_UNSEEN`)."""
    last = max((r.last for r in ranks if r.last is not None), key=lambda s: s.ts_ns, default=None)
    where = "" if last is None else (f" after rank {last.rank} step {format_count(last.step)} at "
                                     f"{format_time(last.ts_ns)}")
    if status == DETACHED:
        return (f"recording was turned off (detached){where} while the process went on: how the run ended was "
                "not recorded.")
    return (f"the process exited{where}; it was watched from outside, so its exit code is unknown (only its "
            "parent process can collect it).")


def running_sentence(ranks: list[RankReadings]) -> str:
    """The lead of an explanation of a run still being recorded: what follows is so far, not how it ended."""
    last = max((r.last for r in ranks if r.last is not None), key=lambda s: s.ts_ns, default=None)
    where = "" if last is None else (f" (rank {last.rank} step {format_count(last.step)} at "
                                     f"{format_time(last.ts_ns)})")
    return f"the run is still being recorded: what follows is as of its last record stored{where}."


def format_time(ts_ns: int) -> str:
    """A record's time in UTC, to the millisecond."""
    seconds, nanos = divmod(ts_ns, 1_000_000_000)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{nanos // 1_000_000:03d} UTC"


def _max(current: int | None, value: int | None) -> int | None:
    if value is None:
        return current
    return value if current is None or value > current else current


def _size(value: int | None) -> str:
    return "unknown" if value is None else format_bytes(value)


def crash_ends(readings: dict[int, RankReadings], dead: set[int]) -> dict[int, Event]:
    """A crashed run without an OOM event: each rank that died ended at its last sample, which is explained
    like an out-of-memory (what grew before it), but with no failing allocation to speak of."""
    ends = {}
    for rank in sorted(dead & set(readings)):
        last = readings[rank].last
        if last is not None:
            ends[rank] = Event(last.run_id, rank, last.step, last.ts_ns, CRASH,
                               {"driver_free_bytes": last.driver_free_bytes, "total_bytes": readings[rank].total_bytes})
    return ends
