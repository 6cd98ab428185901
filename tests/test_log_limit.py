"""Log lines another uid can cause, limited per kind and window, with one summary line for what was dropped; a
log write that blocks in one thread holds up no other thread's dropped lines or flush (a line another thread does
write waits on the handler, as any log line would)."""

from __future__ import annotations

import logging
import threading

import pytest

from memwatch.sidecar.log_limit import LogLimiter


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_past_the_limit_lines_are_counted_and_said_once_with_the_last_when_the_window_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    limited = LogLimiter(logging.getLogger("memwatch.test-limit"), lines=2, window=60.0, clock=clock)
    for i in range(5):
        limited.warning("ring ignored", "ignoring ring %s", f"r{i}")
    limited.warning("other", "another kind: %d", 7)
    clock.now += 59.0
    limited.flush()  # no window has ended: nothing said
    assert [r.getMessage() for r in caplog.records] == ["ignoring ring r0", "ignoring ring r1", "another kind: 7"]
    clock.now += 1.0
    limited.warning("ring ignored", "ignoring ring %s", "r5")  # its window ended: the summary, then a new window
    assert [r.getMessage() for r in caplog.records[3:]] == [
        "3 more 'ring ignored' lines in the last 60 s were not logged (the last: ignoring ring r4)",
        "ignoring ring r5"]
    limited.warning("ring ignored", "plain")
    limited.warning("ring ignored", "plain, dropped")
    clock.now += 10.0
    limited.flush(all_windows=True)  # at exit: every window, however young; 'other' dropped nothing
    assert [r.getMessage() for r in caplog.records[5:]] == [
        "plain", "1 more 'ring ignored' lines in the last 10 s were not logged (the last: plain, dropped)"]
    limited.flush(all_windows=True)
    assert len(caplog.records) == 7  # said once


class _Blocking(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if threading.current_thread().name == "stuck-writer":
            self.entered.set()
            self.gate.wait(30)


def test_a_log_write_that_blocks_holds_up_only_its_own_thread() -> None:
    logger = logging.getLogger("memwatch.test-limit-blocking")
    handler = _Blocking()
    logger.addHandler(handler)
    limited = LogLimiter(logger, lines=1, window=60.0)
    writer = threading.Thread(target=limited.warning, args=("a", "stuck"), name="stuck-writer", daemon=True)
    try:
        writer.start()
        assert handler.entered.wait(5)
        done = threading.Event()

        def others() -> None:  # a line past the limit, and a flush with nothing due: neither writes to the log
            limited.warning("a", "dropped")
            limited.flush()
            done.set()

        threading.Thread(target=others, daemon=True).start()
        assert done.wait(5), "another thread's warning or flush waited for the blocked log write"
    finally:
        handler.gate.set()
        writer.join(5)
    said: list[str] = []
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    limited.flush(all_windows=True)
    logger.removeHandler(handler)
    assert len(said) == 1 and said[0].startswith("1 more 'a' lines in the last ")  # the dropped line, said once
    assert said[0].endswith(" s were not logged (the last: dropped)")
