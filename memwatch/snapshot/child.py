"""The reading child of :mod:`.untrusted`: limits, then an unprivileged uid, then the snapshot, JSON out.

Its standard input is the snapshot file itself, opened and checked by the parent; it is read as the
loader goes (no copy of the whole file), at most ``size_bytes`` of it, and hashed on the way. Run by
root, the child first becomes the uid the parent names (the file's owner, else nobody) with no
supplementary groups, so a flaw in the loader acts with that user's rights, not root's; it needs no
file of its own after that. Its answer is :func:`~memwatch.snapshot.reply.to_plain`'s summary.

Exit codes: 0 with ``{"ok": ...}`` on stdout; 3 when the memory limit was hit; 4 when it could not
give up root. The CPU limit ends it with ``SIGXCPU`` (then ``SIGKILL``); the parent kills it past
the wall-time limit or when it answers more than the parent reads.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import resource
import sys
from typing import Any

from memwatch.errors import UsageError
from memwatch.snapshot.reader import parse_snapshot
from memwatch.snapshot.reply import MAX_ERROR, to_plain


class _TooLarge(Exception):
    """The file grew past the size limit while it was read."""


class _Capped(io.RawIOBase):
    """Standard input as the loader reads it: counted against the limit and hashed."""

    def __init__(self, limit: int) -> None:
        self._raw = io.BufferedReader(io.FileIO(0, "rb", closefd=False), 1 << 16)
        self._left = limit
        self._sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        want = self._left + 1 if size is None or size < 0 else min(size, self._left + 1)
        data = self._raw.read(want) or b""
        return self._take(data)

    def readline(self, size: int | None = -1) -> bytes:
        want = self._left + 1 if size is None or size < 0 else min(size, self._left + 1)
        return self._take(self._raw.readline(want))

    def readinto(self, buffer: Any) -> int:
        """Straight into the loader's buffer: a large ``bytes`` field is held once, not twice."""
        view = memoryview(buffer).cast("B")[: self._left + 1]
        got = self._raw.readinto(view) or 0
        self._take(view[:got])
        return got

    def _take(self, data: Any) -> Any:
        self._left -= len(data)
        if self._left < 0:
            raise _TooLarge
        self._sha.update(data)
        return data

    def sha256(self) -> str:
        """The hash of the whole file: what the loader left after the pickle's end is read too."""
        while self.read(1 << 20):
            pass
        return self._sha.hexdigest()


def _limit(which: int, soft: int, hard: int | None = None) -> None:
    """Lower a limit; never above the hard limit the child was started with."""
    _, current = resource.getrlimit(which)
    hard = soft if hard is None else hard
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def _become(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        os._exit(4)


def main() -> None:
    limits = json.loads(sys.argv[1])
    cpu = int(limits["cpu_s"])
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _limit(resource.RLIMIT_AS, int(limits["memory_bytes"]))
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_FSIZE, 0)
    run_as = limits.get("run_as")
    if run_as is not None and os.geteuid() == 0:
        try:
            _become(int(run_as[0]), int(run_as[1]))
        except OSError:
            os._exit(4)
    size = int(limits["size_bytes"])
    try:
        source = _Capped(size)
        snapshot = parse_snapshot(source, str(limits["name"]))  # type: ignore[arg-type]
        text = json.dumps({"ok": True, **to_plain(snapshot, source.sha256())})
    except UsageError as exc:
        text = json.dumps({"ok": False, "error": str(exc)[:MAX_ERROR]})
    except _TooLarge:
        text = json.dumps({"ok": False, "error": f"{limits['name']} grew past the {size:,} bytes a snapshot may "
                           "have while it was read; give the pickle torch.cuda.memory._dump_snapshot wrote"})
    except MemoryError:
        os._exit(3)
    sys.stdout.buffer.write(text.encode("ascii"))  # json.dumps escapes every other character
    sys.stdout.flush()


if __name__ == "__main__":
    main()
