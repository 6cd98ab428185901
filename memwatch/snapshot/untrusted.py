"""Reading a snapshot file nobody vouches for, at a bounded cost to the reader.

The file may be named by an engine's ``oom`` event or by a user, so it may be anything: a FIFO that
never ends (a read would wait for ever), ``/dev/zero`` (a read would fill memory), a symlink, a
gigabyte, or a pickle that takes a loader for ever. So it is opened with ``O_NOFOLLOW`` and
``O_NONBLOCK``, must be a regular file of at most :attr:`Limits.size_bytes`, and is parsed in a
child process of memwatch's own interpreter with a CPU-time limit (``RLIMIT_CPU``), an address-space
limit (``RLIMIT_AS``) and a wall-clock limit after which it is killed. The child hands back the
snapshot as plain JSON, which is walked again here with the same checks.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from memwatch.errors import NotFoundError, UsageError
from memwatch.snapshot.reader import MemorySnapshot, from_plain

HINT = "give the pickle torch.cuda.memory._dump_snapshot wrote"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class Limits:
    """What reading one snapshot may cost."""

    size_bytes: int = 256 << 20
    cpu_s: int = 60
    memory_bytes: int = 4 << 30
    wall_s: float = 120.0


DEFAULT_LIMITS = Limits()
_children: set[subprocess.Popen[bytes]] = set()
_children_lock = threading.Lock()


def read_file(path: Path, size_limit: int) -> bytes:
    """The bytes of ``path`` when it is a regular file (not a link) of at most ``size_limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFoundError(f"no snapshot file {path}; {HINT}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(f"{path} is a symbolic link; give the snapshot file itself") from None
        raise UsageError(f"cannot read {path}: {exc.strerror}; check the path and its permissions") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{path} is not a regular file ({_kind(info.st_mode)}); {HINT}")
        if info.st_size > size_limit:
            raise UsageError(f"{path} is {info.st_size:,} bytes, more than the {size_limit:,} a snapshot may have; "
                             f"{HINT}")
        parts: list[bytes] = []
        size = 0
        while size <= size_limit:
            chunk = os.read(fd, min(1 << 20, size_limit + 1 - size))
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        if size > size_limit:
            raise UsageError(f"{path} grew past the {size_limit:,} bytes a snapshot may have while read; {HINT}")
        return b"".join(parts)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}; check the path and its permissions") from None
    finally:
        os.close(fd)


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
    raw = read_file(path, limits.size_bytes)
    return parse_in_child(raw, str(path), limits), hashlib.sha256(raw).hexdigest()


def parse_in_child(raw: bytes, name: str, limits: Limits = DEFAULT_LIMITS) -> MemorySnapshot:
    """:func:`~memwatch.snapshot.reader.parse_snapshot` in a child process that is killed past ``limits``."""
    code = f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); from memwatch.snapshot.child import main; main()"
    proc = subprocess.Popen([sys.executable, "-I", "-c", code, json.dumps({"name": name, **asdict(limits)})],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={"LC_ALL": "C.UTF-8"}, cwd="/", start_new_session=True)
    with _children_lock:
        _children.add(proc)
    try:
        out, _ = proc.communicate(raw, timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise UsageError(f"{name} took more than {limits.wall_s:g}s to read and was given up (the wall-time limit); "
                         f"{HINT}") from None
    finally:
        with _children_lock:
            _children.discard(proc)
    if proc.returncode != 0:
        raise UsageError(f"{name} could not be read within the limits ({_death(proc.returncode, limits)}); {HINT}")
    try:
        answer = json.loads(out)
        if answer.get("ok"):
            return from_plain(answer["snapshot"])
        error = str(answer["error"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"{name} could not be read (its reader answered badly: {type(exc).__name__}); {HINT}") \
            from None
    raise UsageError(error)


def _death(code: int, limits: Limits) -> str:
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"it used more than {limits.cpu_s}s of CPU time"
    if code == 3:
        return f"it needed more than {limits.memory_bytes >> 20} MiB of memory"
    return f"the reader exited with {code}"


def stop_readers() -> None:
    """Kill every reading child still running (the sidecar is stopping)."""
    with _children_lock:
        running = list(_children)
    for proc in running:
        if proc.poll() is None:
            proc.kill()
