"""A shared runtime directory flooded with names by an untrusted member of its group, for the flood tests and benches.

The neighbour is a uid of the directory's group that the sidecar does not trust: it makes COUNT empty ``*.ring``
names, then creates and removes one more every 0.5 s, so the directory never stays unchanged. It runs as that
uid (``setpriv``, so root is needed), from the host side, as a process in another pod sharing the node's
directory would appear. Nothing here imports memwatch: benches import it from bench/, tests put bench/ on
``sys.path``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

GROUP, ATTACKER, ENGINE = 50000, 50001, 65534
"""The runtime directory's group, the untrusted member that floods it, the trusted engine's uid."""
FLOOD = """
import os, sys
d = os.open(".", os.O_RDONLY)
for i in range(int(sys.argv[1])):
    os.close(os.open(f"junk{i:07d}.ring", os.O_CREAT | os.O_WRONLY, 0o640, dir_fd=d))
"""
TOGGLE = """
import os, time
while True:
    os.close(os.open("toggle.ring", os.O_CREAT | os.O_WRONLY, 0o640))
    time.sleep(0.25)
    os.unlink("toggle.ring")
    time.sleep(0.25)
"""


def refused() -> str | None:
    """Why a flood cannot be made here (None when it can)."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        return "an untrusted group member needs root and setpriv (util-linux)"
    return None


def as_uid(uid: int, code: str, *args: str, cwd: Path, group: int = GROUP) -> subprocess.Popen[str]:
    """``python -c code args`` as ``uid`` with ``group`` its primary and only group; its stdout a text pipe."""
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={group}", f"--groups={group}", sys.executable,
                             "-c", code, *args], cwd=cwd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def shared_rings(base: Path, group: int = GROUP) -> Path:
    """``base/rings`` made as a shared runtime directory is (mode 3770, root's, group ``group``), ``base``
    passable by every uid (0711)."""
    base.chmod(0o711)
    rings = base / "rings"
    rings.mkdir()
    os.chown(rings, 0, group)
    rings.chmod(0o3770)
    return rings


def flood(rings: Path, count: int, *, uid: int = ATTACKER, group: int = GROUP, timeout: float = 1800) -> None:
    """``count`` empty ``junkNNNNNNN.ring`` names made in ``rings`` by ``uid``; returns once all are there."""
    maker = as_uid(uid, FLOOD, str(count), cwd=rings, group=group)
    try:
        code = maker.wait(timeout=timeout)
    finally:
        if maker.poll() is None:
            maker.kill()
            maker.wait(timeout=30)
        assert maker.stdout is not None
        maker.stdout.close()
    if code != 0:
        raise RuntimeError(f"uid {uid} could not make {count:,} names in {rings}: exit {code}")


def toggler(rings: Path, *, uid: int = ATTACKER, group: int = GROUP) -> subprocess.Popen[str]:
    """``toggle.ring`` created and removed every 0.5 s by ``uid`` until the process is killed."""
    return as_uid(uid, TOGGLE, cwd=rings, group=group)


def stop(process: subprocess.Popen[str]) -> None:
    """A process of :func:`as_uid` killed (if still running), waited for, its pipe closed."""
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)
    if process.stdout is not None:
        process.stdout.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HealthProbe(threading.Thread):
    """``GET /healthz`` every 0.2 s, each with a 1 s limit (the kubelet's default probe timeout); what each
    answered: the status, the status and body of an error, or why nothing answered in time."""

    def __init__(self, port: int, *, every: float = 0.2, limit: float = 1.0) -> None:
        super().__init__(name="healthz-probe", daemon=True)
        self.port, self.every, self.limit = port, every, limit
        self.answers: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=self.limit) as reply:
                    self.answers.append(str(reply.status))
            except urllib.error.HTTPError as exc:
                self.answers.append(f"{exc.code} {exc.read().decode(errors='replace').strip()}")
            except OSError as exc:
                self.answers.append(f"no answer within {self.limit:g} s: {exc}")

    def stop(self) -> list[str]:
        """Stops asking; the answers."""
        self.done.set()
        self.join(timeout=5)
        return self.answers
