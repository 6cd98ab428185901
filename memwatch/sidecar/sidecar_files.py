"""The sidecar's own files: a private state directory holding its lock and pid file, and a presence marker.

A shared runtime directory (mode 3770) is written by other uids, so nothing the sidecar relies on lives
there: its lock, pid file, temporary files and set-aside rings live in a state directory of its own
(owned by its uid, mode 0700, opened once with ``O_DIRECTORY|O_NOFOLLOW`` and judged by ``fstat``;
everything after goes through that descriptor). One state directory per runtime directory, and the lock
in it makes one sidecar per runtime directory:

- a private runtime directory (ours, 0700) is its own state directory: no other uid can write there;
- a shared one gets ``sidecar-<its path>-<hash>`` beside the database (``/var/lib/memwatch`` in the
  DaemonSet, the agent's other writable volume; the root file system is read-only), or
  ``--state-dir``/``$MEMWATCH_STATE_DIR``.

Where the state directory is not the runtime directory, the sidecar publishes ``sidecar.present`` there
(mode 0640, locked while it runs) so that engines can tell an agent serves it; anyone in the group could
make such a file, so it is a hint for them and the sidecar never reads it.

A pid read from the pid file is signalled (the take-over of an auto-started sidecar) only through a pidfd,
once the process it pins is shown to be that sidecar: the start time the file recorded, our uid, and a
``memwatch serve`` command line.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import signal
import struct
from dataclasses import dataclass
from pathlib import Path

from memwatch_engine.dirfd import create_exclusive, file_id, private_dir, read_small, replace_file, unlink_if_same
from memwatch_engine.liveness import file_lock_held, process_start_ticks
from memwatch_engine.runtime import LOCK_NAME, PID_NAME, PRESENCE_NAME, is_shared_dir

log = logging.getLogger("memwatch.serve")

_FLOCK = struct.Struct("hhqqi4x")
"""``struct flock`` on 64-bit Linux: type, whence, start, len, pid (and padding)."""
PROC_READ_LIMIT = 64 * 1024
"""The most bytes read of one ``/proc/PID`` file (a command line may be long, never this long for a sidecar)."""


def default_state_dir(runtime_dir: Path, runtime_info: os.stat_result, db_path: Path) -> Path:
    """Where a sidecar keeps its own files by default (see the module's docstring)."""
    if not is_shared_dir(runtime_info) and runtime_info.st_uid == os.getuid():
        return runtime_dir
    real = os.path.realpath(runtime_dir)
    slug = re.sub(r"[^A-Za-z0-9._]+", "-", real).strip("-.")[:48] or "root"
    digest = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return db_path.parent / f"sidecar-{slug}-{digest}"


@dataclass(frozen=True)
class PidFile:
    """What ``sidecar.pid`` says: the holder's pid, its start time (clock ticks since boot), whether auto-started."""

    pid: int
    start: int
    auto: bool


class StateDir:
    """The open state directory: its lock, pid file and (in another runtime directory) the presence marker."""

    def __init__(self, path: Path, runtime_fd: int) -> None:
        self.path = path
        self.fd = private_dir(path)
        self._runtime_fd = runtime_fd
        self.is_runtime_dir = file_id(os.fstat(self.fd)) == file_id(os.fstat(runtime_fd))
        self._lock_fd = -1
        self._marker: tuple[int, tuple[int, int]] | None = None

    def try_lock(self) -> bool:
        """Take the sidecar's lock (``F_OFD_SETLK``: asking about it, as engines do, never takes it)."""
        if self._lock_fd < 0:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                         dir_fd=self.fd)
            self._lock_fd = fd
        try:
            fcntl.fcntl(self._lock_fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        except (BlockingIOError, PermissionError):
            return False
        return True

    def another_serves_runtime_dir(self) -> bool:
        """Whether a sidecar with another state directory serves our private runtime directory (its lock or its
        marker there is held). Only asked where the runtime directory is ours alone: in a shared one anyone in the
        group could hold such a file, and the state directory's lock is what counts."""
        info = os.fstat(self._runtime_fd)
        if is_shared_dir(info) or info.st_uid != os.getuid():
            return False
        names = (PRESENCE_NAME,) if self.is_runtime_dir else (LOCK_NAME, PRESENCE_NAME)
        return any(file_lock_held(self._runtime_fd, name) for name in names)

    def write_pid(self, auto: bool) -> None:
        pid = os.getpid()
        replace_file(self.fd, PID_NAME, f"{pid} {process_start_ticks(pid)}{' auto' if auto else ''}\n".encode())

    def read_pid(self) -> PidFile | None:
        try:
            fields = read_small(self.fd, PID_NAME, owner=os.geteuid(), limit=256).split()
            return PidFile(int(fields[0]), int(fields[1]), fields[2:3] == [b"auto"])
        except (OSError, ValueError, IndexError):
            return None

    def publish_presence(self) -> None:
        """Create ``sidecar.present`` in the runtime directory (exclusively, 0640) and hold its lock."""
        if self.is_runtime_dir:
            return
        for _ in range(2):
            try:
                fd = create_exclusive(self._runtime_fd, PRESENCE_NAME, 0o640)
                break
            except FileExistsError:
                try:  # ours from a run that was killed, or anyone's: replaced, never read
                    os.unlink(PRESENCE_NAME, dir_fd=self._runtime_fd)
                except OSError as exc:
                    log.warning("cannot replace %s in the runtime directory: %s; engines there will not see that "
                                "a sidecar runs", PRESENCE_NAME, exc.strerror or exc)
                    return
            except OSError as exc:
                log.warning("cannot publish %s in the runtime directory: %s", PRESENCE_NAME, exc.strerror or exc)
                return
        else:
            return
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        except OSError:
            pass  # a hint without its lock: engines take it as no sidecar
        self._marker = (fd, file_id(os.fstat(fd)))

    def close(self) -> None:
        """Remove our pid file and marker (only while their names still denote our files), then drop the lock."""
        if self._marker is not None:
            fd, ident = self._marker
            try:
                unlink_if_same(self._runtime_fd, PRESENCE_NAME, ident)
            except OSError:
                pass
            os.close(fd)
            self._marker = None
        if self._lock_fd >= 0:
            holder = self.read_pid()
            if holder is not None and holder.pid == os.getpid():
                try:
                    os.unlink(PID_NAME, dir_fd=self.fd)
                except OSError:
                    pass
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def signal_sidecar(holder: PidFile, signum: int = signal.SIGTERM) -> bool:
    """Signal the process a pid file names, only if it is that sidecar; whether it was signalled.

    The pid is pinned with ``pidfd_open`` first, then the process is checked: its start time is the one the
    pid file recorded (a reused pid has another), it runs as our uid, and its command line is ``memwatch
    serve``. The signal goes to the pidfd, so it reaches that process or nobody.
    """
    if holder.start <= 0:
        return False
    try:
        pidfd = os.pidfd_open(holder.pid)
    except (OSError, AttributeError):
        return False
    try:
        if not is_that_sidecar(holder.pid, holder.start):
            return False
        signal.pidfd_send_signal(pidfd, signum)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)


def is_that_sidecar(pid: int, start: int) -> bool:
    """Whether ``pid`` is a live ``memwatch serve`` of our uid that started at ``start`` (ticks since boot)."""
    stat = _proc(pid, "stat")
    status = _proc(pid, "status")
    cmdline = _proc(pid, "cmdline")
    try:
        fields = stat[stat.rindex(b")") + 2:].split()
        state, started = fields[0], int(fields[19])
    except (ValueError, IndexError):
        return False
    if state in (b"Z", b"X") or started != start:
        return False
    uids = next((line.split()[1:] for line in status.splitlines() if line.startswith(b"Uid:")), [])
    if not uids or any(uid != str(os.geteuid()).encode() for uid in uids):
        return False
    argv = cmdline.split(b"\0")
    return b"serve" in argv and any(b"memwatch" in arg for arg in argv[:3])


def _proc(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb", buffering=0) as f:
            return f.read(PROC_READ_LIMIT)
    except OSError:
        return b""
