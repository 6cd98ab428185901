"""Several writers on one ring: threads, a signal handler inside a step, and the step's slow paths.

The Monitor's step packs straight into the ring without a lock (``memwatch_engine.stepper``); these
tests hold it to the promise that no record is torn, lost or duplicated and that no writer waits.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from memwatch_engine import Monitor
from memwatch_engine.ring_reader import RingReader

from probes import ScriptedProbe

STEPS_A_THREAD = 3000
EVENTS_A_THREAD = 400
NOTE = "x" * 300  # 300 characters: the event's JSON takes four 96-byte chunks


def _monitor(runtime_dir: Path, **kwargs: object) -> Monitor:
    return Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False, **kwargs)


def test_threads_share_a_ring_and_every_record_arrives_whole(runtime_dir: Path) -> None:
    monitor = _monitor(runtime_dir, capacity=1 << 15)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython will, inside the writes too
    start = threading.Barrier(4)

    def stepper(tag: int) -> None:
        start.wait(timeout=10)
        for _ in range(STEPS_A_THREAD):
            monitor.step("decode", num_seqs=tag, num_tokens=tag)

    def eventer(tag: int) -> None:
        start.wait(timeout=10)
        for i in range(EVENTS_A_THREAD):
            monitor.event("note", {"thread": tag, "i": i, "text": NOTE})

    threads = [threading.Thread(target=stepper, args=(t,)) for t in (1, 2)]
    threads += [threading.Thread(target=eventer, args=(t,)) for t in (3, 4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        sys.setswitchinterval(previous)
    assert not any(thread.is_alive() for thread in threads)
    assert monitor.enabled
    steps = monitor.step_count
    monitor.close()  # writes what is still queued (a record queued behind a step waits for the next write)
    drained = RingReader(monitor.ring_path).drain(0)
    # Every record of every writer, in consecutive slots: 2 x 3,000 samples and 2 x 400 events of 4 chunks,
    # then the closing sample and run_end.
    assert drained.next_cursor == 2 * STEPS_A_THREAD + 2 * EVENTS_A_THREAD * 4 + 2
    drained.samples.pop()  # the closing sample
    assert drained.lost == 0 and drained.bad == []
    assert Counter(s[15] for s in drained.samples) == {1: STEPS_A_THREAD, 2: STEPS_A_THREAD}
    assert all(s[12] == s[15] and s[4] == 2 for s in drained.samples), "no sample mixes two steps' fields"
    for tag in (3, 4):
        mine = [data for _, _, _, kind, data in drained.events if kind == "note" and data["thread"] == tag]
        assert [data["i"] for data in mine] == list(range(EVENTS_A_THREAD))  # each thread's own order kept
        assert all(data["text"] == NOTE for data in mine)
    assert steps <= 2 * STEPS_A_THREAD


class HandlerClock:
    """A clock that, once armed, runs ``handler`` the way a signal handler would: in the middle of a step."""

    def __init__(self, handler: object) -> None:
        self.now, self.armed, self.handler = 1_000_000, False, handler

    def __call__(self) -> int:
        if self.armed:
            self.armed = False
            self.handler()  # type: ignore[operator]
        self.now += 1000
        return self.now


def test_a_write_from_inside_a_step_is_queued_and_follows_it(runtime_dir: Path) -> None:
    clock = HandlerClock(lambda: monitor.event("from_handler", {"n": 1}))
    monitor = _monitor(runtime_dir, clock=clock)
    monitor.step("decode", num_seqs=1)
    clock.armed = True
    monitor.step("decode", num_seqs=2)  # its clock writes an event while the step holds the ring
    monitor.step("decode", num_seqs=3)
    drained = RingReader(monitor.ring_path).drain(0)
    assert [s[15] for s in drained.samples] == [1, 2, 3]
    seq_of = {s[15]: s[0] for s in drained.samples}
    (event,) = [e for e in drained.events if e[3] == "from_handler"]
    assert seq_of[2] < event[0] < seq_of[3]  # written by the step it interrupted, right after its sample
    assert event[4] == {"n": 1} and drained.bad == [] and drained.lost == 0


@pytest.mark.timeout(60)
def test_signal_handlers_that_write_never_deadlock_a_stepping_engine(runtime_dir: Path) -> None:
    monitor = _monitor(runtime_dir)
    numbers = itertools.count(1)  # next() is one bytecode: a handler nested in another cannot take its number
    fired: list[int] = []
    done = threading.Event()

    def handler(signum: int, frame: object) -> None:
        n = next(numbers)
        monitor.event("tick", {"n": n})
        fired.append(n)

    def interrupt(main: int) -> None:  # a signal every 100 us, delivered to the stepping thread
        while not done.wait(0.0001):
            signal.pthread_kill(main, signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, handler)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # let the sender wake every 100 us, not every 5 ms
    sender = threading.Thread(target=interrupt, args=(threading.get_ident(),))
    sender.start()
    steps = 0
    try:
        deadline = time.monotonic() + 10
        while len(fired) < 300 and steps < 50_000 and time.monotonic() < deadline:  # within the ring's 65,536 slots
            monitor.step("decode", num_seqs=7)
            steps += 1
    finally:
        done.set()
        sender.join(timeout=5)
        sys.setswitchinterval(previous)
        signal.signal(signal.SIGUSR1, old)
    assert len(fired) > 50 and monitor.enabled
    monitor.close()  # the last tick may wait, queued, for the next write
    drained = RingReader(monitor.ring_path).drain(0)
    # Every handler's tick once. A handler that lands inside another before its write writes first, so the
    # ring holds them in the order their writes began, not always in the order of their numbers.
    assert sorted(e[4]["n"] for e in drained.events if e[3] == "tick") == list(range(1, len(fired) + 1))
    assert len(drained.samples) == steps + 1 and drained.bad == [] and drained.lost == 0  # and the closing one


def test_counts_given_as_none_and_unknown_kinds_are_recorded_as_unknown(runtime_dir: Path) -> None:
    monitor = _monitor(runtime_dir)
    monitor.step("decode", num_seqs=None, num_tokens=5, kv_blocks_used=None, kv_blocks_total=9)
    monitor.step("verify", num_seqs=4)  # a kind the ring has no code for
    monitor.step()
    samples = RingReader(monitor.ring_path).drain(0).samples
    fields = [(s[5], s[4], s[12], s[13], s[14], s[15]) for s in samples]  # step, kind, tokens, kv used/total, seqs
    assert fields == [(1, 2, 5, -1, 9, -1), (2, 0, -1, -1, -1, 4), (3, 0, -1, -1, -1, -1)]


def test_a_count_that_is_not_an_integer_turns_the_monitor_off_once(runtime_dir: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    monitor = _monitor(runtime_dir)
    with caplog.at_level(logging.WARNING, logger="memwatch"):
        monitor.step("decode", num_tokens=1.5)  # type: ignore[arg-type]
        monitor.step("decode", num_tokens=2)
    assert not monitor.enabled
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1
    assert RingReader(monitor.ring_path).drain(0).samples == []


def test_close_takes_the_ring_from_a_writer_and_writes_what_waited(runtime_dir: Path) -> None:
    monitor = _monitor(runtime_dir)
    monitor.step("decode", num_seqs=1)
    writer = monitor._writer
    assert writer is not None
    seq = writer._cursor.pop()  # another thread's write in progress
    monitor.event("waited", {"n": 1})  # finds the ring busy: queued, and the call returns at once
    assert writer.written == seq
    threading.Timer(0.05, writer._cursor.append, (seq,)).start()  # that write ends, without looking at the queue
    began = time.monotonic()
    monitor.close()
    assert time.monotonic() - began < 0.5
    reader = RingReader(monitor.ring_path)
    kinds = [e[3] for e in reader.drain(0).events]
    assert kinds == ["waited", "run_end"] and reader.closed


def test_a_forked_child_never_writes_its_parents_ring(runtime_dir: Path) -> None:
    """Forked in the middle of another thread's write (the cursor popped), or not: the child's Monitor turns
    itself off instead of writing slots its parent writes too, and the parent's ring stays whole."""
    monitor = _monitor(runtime_dir)
    monitor.step("decode", num_seqs=1)
    writer = monitor._writer
    assert writer is not None
    held = writer._cursor.pop()  # a write in progress in another thread while the engine forks
    pid = os.fork()
    if pid == 0:  # the child: steps and records as a careless worker would, then reports what it saw
        code = 1
        try:
            monitor.step("decode", num_seqs=99)
            monitor.event("from_child", {})
            monitor.close()
            code = 0 if not monitor.enabled and writer.written == held else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    writer._cursor.append(held)  # the parent's write ends
    monitor.step("decode", num_seqs=2)
    monitor.close()
    reader = RingReader(monitor.ring_path)
    drained = reader.drain(0)
    assert [s[15] for s in drained.samples if s[4] == 2] == [1, 2]  # the parent's two steps, nothing of the child
    assert "from_child" not in [e[3] for e in drained.events] and drained.bad == [] and reader.closed


def test_records_queued_while_the_ring_was_busy_are_written_before_later_ones(runtime_dir: Path) -> None:
    """A holder gives the cursor back, and before it looks at the queue this thread writes again: what it
    queued earlier still comes first, whether the later record is an event or a step."""
    monitor = _monitor(runtime_dir)
    writer = monitor._writer
    assert writer is not None
    for later in ("event", "step"):
        seq = writer._cursor.pop()  # another thread's write in progress
        monitor.event("queued", {"before": later})  # finds the ring busy: queued
        writer._cursor.append(seq)  # that write ends; its look at the queue has not come yet
        if later == "event":
            monitor.event("later", {})
        else:
            monitor.step("decode", num_seqs=5)
    monitor.close()
    drained = RingReader(monitor.ring_path).drain(0)
    order = sorted([(e[0], e[3]) for e in drained.events if e[3] in ("queued", "later")]
                   + [(s[0], "step") for s in drained.samples if s[15] == 5])
    assert [name for _, name in order] == ["queued", "later", "queued", "step"]
