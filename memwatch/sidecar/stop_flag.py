"""A stop request that a signal handler can make: no lock is taken to set it.

Python runs a signal handler in the main thread between two bytecodes, wherever the thread is. A handler
that calls ``threading.Event.set`` takes the event's lock, and the main thread may be holding that very lock
in ``Event.wait`` at that moment (the sidecar's loop waits on its stop event several times a second): the
handler then waits for itself, and SIGTERM hangs the process instead of stopping it. So the request is a flag
and a byte written to a pipe, and a waiter sleeps in ``poll`` on the pipe's other end (``select`` refuses a
descriptor past 1,023, which a sidecar holding many rings can reach), which a set from any thread or from a
handler wakes at once.
"""

from __future__ import annotations

import math
import os
import select
import weakref


class StopFlag:
    """Set once from anywhere (a signal handler, another thread); waited on with a timeout."""

    def __init__(self) -> None:
        self._set = False
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # closed with the flag, never before: a set after a close would write to whatever took the number
        weakref.finalize(self, _close, self._wake_read, self._wake_write)

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._wake_write, b"\0")
        except OSError:  # a full pipe: whoever waits is woken already
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Whether the flag is set, waiting up to ``timeout`` seconds for it."""
        if not self._set and timeout > 0:
            waiter = select.poll()  # one per wait: a poll object refuses two threads polling it at once
            waiter.register(self._wake_read, select.POLLIN)
            waiter.poll(math.ceil(timeout * 1000))
        return self._set


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)
