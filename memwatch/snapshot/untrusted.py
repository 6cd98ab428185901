"""Reading a snapshot file nobody vouches for, at a bounded cost to the reader.

The file may be named by an engine's ``oom`` event or by a user, so it may be anything: a FIFO that
never ends (a read would wait for ever), ``/dev/zero`` (a read would fill memory), a symlink, a
gigabyte, or a pickle that takes a loader for ever. So it is opened with ``O_NOFOLLOW`` and
``O_NONBLOCK``, judged by ``fstat`` of that descriptor (a regular file of at most
:attr:`Limits.size_bytes`), and that descriptor is the standard input of a child process of
memwatch's own interpreter, which parses it with a CPU-time limit (``RLIMIT_CPU``), an
address-space limit (``RLIMIT_AS``) and a wall-clock limit after which it is killed, as the file's
owner (or nobody) when memwatch runs as root. This process never holds the file's bytes: it reads at
most :data:`~memwatch.snapshot.reply.MAX_REPLY_BYTES` of the child's answer, a bounded summary, and
checks it again (:mod:`.reply`). One child runs at a time per process.

Memory: the child is capped at :attr:`Limits.memory_bytes` (384 MiB of address space, so at most
403 MB resident), and the parent's share is the answer (at most 18 MiB of ASCII JSON, parsed into a
few times that at most), so an import peaks under 512 MB whatever the file holds
(``bench/bench_snapshot.py`` measures both).
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from memwatch.errors import NotFoundError, UsageError
from memwatch.snapshot.reader import MemorySnapshot
from memwatch.snapshot.reply import MAX_ERROR, MAX_REPLY_BYTES, from_plain, parse_reply

HINT = "give the pickle torch.cuda.memory._dump_snapshot wrote"
MEMORY_HINT = ("a snapshot takes about 5 times its size to load: record a shorter history "
               "(torch.cuda.memory._record_memory_history(max_entries=...))")
NOBODY = 65534
"""The uid and gid the reading child takes, when run by root, for a file root owns."""
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
CHILD_CODE = f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); from memwatch.snapshot.child import main; main()"
"""What the reading child runs: memwatch's own interpreter, isolated (``-I``), importing only memwatch."""
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


@dataclass(frozen=True)
class Limits:
    """What reading one snapshot may cost."""

    size_bytes: int = 256 << 20
    cpu_s: int = 60
    memory_bytes: int = 384 << 20
    wall_s: float = 120.0


DEFAULT_LIMITS = Limits()
_children: set[subprocess.Popen[bytes]] = set()
_children_lock = threading.Lock()
_one_at_a_time = threading.Lock()


def open_snapshot(path: Path, *, dir_fd: int | None = None, shown: str | None = None) -> int:
    """A descriptor of ``path`` (not following a symlink, not waiting on a FIFO); errors as one line.

    ``path`` is relative to the directory ``dir_fd`` when given; ``shown`` is the name errors use.
    """
    shown = str(path) if shown is None else shown
    try:
        return os.open(path, OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise NotFoundError(f"no snapshot file {shown}; {HINT}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(f"{shown} is a symbolic link; give the snapshot file itself") from None
        raise UsageError(f"cannot read {shown}: {exc.strerror}; check the path and its permissions") from None


def checked(fd: int, name: str, size_limit: int) -> os.stat_result:
    """``fstat`` of the open descriptor, when it is a regular file of at most ``size_limit`` bytes."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{name} is not a regular file ({_kind(info.st_mode)}); {HINT}")
    if info.st_size > size_limit:
        raise UsageError(f"{name} is {info.st_size:,} bytes, more than the {size_limit:,} a snapshot may have; {HINT}")
    return info


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a plain file"


def read_snapshot(path: str | Path, limits: Limits = DEFAULT_LIMITS) -> tuple[MemorySnapshot, str]:
    """Load and validate a snapshot file within ``limits``, with the SHA-256 of its bytes; one error if it fails."""
    path = Path(path)
    fd = open_snapshot(path)
    try:
        info = checked(fd, str(path), limits.size_bytes)
        return read_open(fd, info, str(path), limits)
    finally:
        os.close(fd)


def read_open(fd: int, info: os.stat_result, name: str,
              limits: Limits = DEFAULT_LIMITS) -> tuple[MemorySnapshot, str]:
    """The snapshot in the open, :func:`checked` descriptor ``fd``, parsed by a child as the file's owner."""
    return _in_child(fd, name, limits, _reader_identity(info.st_uid))


def parse_in_child(raw: bytes, name: str, limits: Limits = DEFAULT_LIMITS) -> MemorySnapshot:
    """:func:`~memwatch.snapshot.reader.parse_snapshot` of ``raw`` in a child killed past ``limits``."""
    fd = os.memfd_create("memwatch-snapshot", os.MFD_CLOEXEC)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        return _in_child(fd, name, limits, _reader_identity(NOBODY))[0]
    finally:
        os.close(fd)


def _reader_identity(owner: int) -> tuple[int, int] | None:
    """The (uid, gid) the child parses as: as root, the file's owner (nobody for root's own files)."""
    if os.geteuid() != 0:
        return None
    return (owner if owner != 0 else NOBODY), NOBODY


def _in_child(fd: int, name: str, limits: Limits, run_as: tuple[int, int] | None) -> tuple[MemorySnapshot, str]:
    if not _one_at_a_time.acquire(timeout=limits.wall_s + 10):
        raise UsageError(f"{name} was not read: another snapshot import did not end in time; try again")
    try:
        out = _run(fd, name, limits, run_as)
    finally:
        _one_at_a_time.release()
    try:
        answer = parse_reply(out)
        if answer.get("ok") is True:
            return from_plain(answer)
        error = answer["error"]
        if not isinstance(error, str):
            raise TypeError("error")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise UsageError(f"{name} could not be read (its reader answered badly: {type(exc).__name__}); {HINT}") \
            from None
    raise UsageError(error[:MAX_ERROR])


def _run(fd: int, name: str, limits: Limits, run_as: tuple[int, int] | None) -> bytes:
    """The child's answer: at most :data:`MAX_REPLY_BYTES`, within the wall-time limit, else one error."""
    arguments = json.dumps({"name": name, "run_as": run_as, **asdict(limits)})
    proc = subprocess.Popen([sys.executable, "-I", "-c", CHILD_CODE, arguments], stdin=fd, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env={"LC_ALL": "C.UTF-8"}, cwd="/", start_new_session=True)
    with _children_lock:
        _children.add(proc)
    try:
        parts, why = _collect(proc, time.monotonic() + limits.wall_s)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
        with _children_lock:
            _children.discard(proc)
    if why == "time":
        raise UsageError(f"{name} took more than {limits.wall_s:g}s to read and was given up (the wall-time limit); "
                         f"{HINT}")
    if why == "size":
        raise UsageError(f"{name} could not be read (its reader answered more than {MAX_REPLY_BYTES:,} bytes); "
                         f"{HINT}")
    if proc.returncode != 0:
        hint = MEMORY_HINT if proc.returncode == 3 else HINT
        raise UsageError(f"{name} could not be read within the limits ({_death(proc.returncode, limits)}); {hint}")
    return b"".join(parts)


def _collect(proc: subprocess.Popen[bytes], deadline: float) -> tuple[list[bytes], str | None]:
    """Read the child's output until it ends, the deadline passes ("time") or it is too long ("size")."""
    assert proc.stdout is not None
    out = proc.stdout.fileno()
    poller = select.poll()
    poller.register(out, select.POLLIN | select.POLLHUP)
    parts: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return parts, "time"
        if not poller.poll(min(left, 1.0) * 1000):
            continue
        chunk = os.read(out, 1 << 20)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            return parts, "size"
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return parts, "time"
    return parts, None


def _death(code: int, limits: Limits) -> str:
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"it used more than {limits.cpu_s}s of CPU time"
    if code == 3:
        return f"it needed more than {limits.memory_bytes >> 20} MiB of memory"
    if code == 4:
        return "it could not give up root's privileges"
    return f"the reader exited with {code}"


def stop_readers() -> None:
    """Kill every reading child still running (the sidecar is stopping)."""
    with _children_lock:
        running = list(_children)
    for proc in running:
        if proc.poll() is None:
            proc.kill()
