"""Containers for tests: an engine and a sidecar in pid, mount and user namespaces of their own.

What a container runtime does that matters to memwatch, done with ``unshare`` and ``setpriv``:

- a pid namespace (``--pid --fork --mount-proc``): the process is pid 1 there, its ``/proc`` shows
  only its own processes, and its pid means nothing to the other side;
- a mount namespace in which the shared directory (the volume) is bind-mounted at a path of its own,
  as a pod's ``emptyDir`` is mounted into each container;
- optionally a user namespace (``--user --map-root-user``: root inside, the caller's uid outside);
- optionally another uid and gid (``setpriv``), as a non-root engine image runs.

Each side runs the real ``memwatch serve`` or a real Monitor writing a real ring.
"""

from __future__ import annotations

import os
import select
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from processes import memwatch_env, wait_for

TESTS = str(Path(__file__).parent)

ENGINE = """
import os, sys, time
sys.path.insert(0, {tests!r})
from probes import ScriptedProbe
from memwatch_engine import Monitor
m = Monitor(engine="script", model="tiny", probe=ScriptedProbe(), spawn_sidecar=False, run_id={run_id!r})
assert m.enabled, "monitor off"
print("ready", os.getpid(), flush=True)
steps = {steps}
with m.phase("serve"):
    i = 0
    while steps < 0 or i < steps:
        m.step("decode", num_seqs=1, num_tokens=1)
        i += 1
        time.sleep({pause})
m.close()
print("done", flush=True)
"""


@dataclass(frozen=True)
class Shape:
    """Where one side runs: its own pid (and mount) namespace, a user namespace, another uid."""

    pid_ns: bool = False
    user_ns: bool = False
    uid: int | None = None
    gid: int | None = None


def namespaces_refused() -> str | None:
    """Why namespaces cannot be used here (None when they can): the kernel or the sandbox may refuse them."""
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--user", "--map-root-user", "true"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare cannot run: {exc}"
    if done.returncode != 0:
        return f"the kernel refuses new pid/mount/user namespaces: {done.stderr.strip()}"
    if os.getuid() != 0:
        return "running as another uid needs root (setpriv --reuid)"
    return None


def wrap(argv: list[str], shape: Shape, volume: Path, view: Path) -> list[str]:
    """``argv`` run in ``shape``, with ``volume`` bind-mounted at ``view`` when it has a mount namespace."""
    inner = list(argv)
    if shape.uid is not None:
        gid = shape.gid if shape.gid is not None else shape.uid
        inner = ["setpriv", f"--reuid={shape.uid}", f"--regid={gid}", "--clear-groups", *inner]
    if not shape.pid_ns:
        return inner
    outer = ["unshare", "--pid", "--fork", "--mount-proc", "--propagation", "private"]
    if shape.user_ns:
        outer += ["--user", "--map-root-user"]
    script = f"mount --bind {shlex.quote(str(volume))} {shlex.quote(str(view))} && exec {shlex.join(inner)}"
    return [*outer, "sh", "-c", script]


def _inside_pid(proc: subprocess.Popen[str]) -> int:
    """The host pid of the process that ``wrap`` runs (under unshare and sh, which it replaces)."""
    def leaf() -> int | None:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return None
        return next((child.pid for child in children if _runs_python(child)), None)

    if proc.args[0] != "unshare":
        return proc.pid
    return wait_for(leaf, timeout=20, what="the process inside its namespace")


def _runs_python(process: psutil.Process) -> bool:
    try:
        return "python" in " ".join(process.cmdline()[:1])
    except psutil.NoSuchProcess:  # gone, or a zombie (``mount`` exited, not yet reaped by sh)
        return False


class Side:
    """One container: a process in its shape, with the volume where it expects it."""

    def __init__(self, argv: list[str], shape: Shape, volume: Path, view: Path, env: dict[str, str]) -> None:
        self.shape = shape
        self.proc = subprocess.Popen(wrap(argv, shape, volume, view), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.host_pid = _inside_pid(self.proc)

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.host_pid, sig)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float = 60.0) -> tuple[int, str]:
        output, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, output

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Pod:
    """A shared volume with the runtime directory in it, and the containers that use it.

    The volume lives under ``/tmp`` (not pytest's private tmp directory) so that another uid can reach
    it; each side sees it at a path of its own when it has a mount namespace.
    """

    def __init__(self, base: Path, *, shared_group: int | None = None) -> None:
        self.base = base
        base.chmod(0o711)
        self.volume = base / "volume"
        self.volume.mkdir()
        self.rings = self.volume / "rings"
        self.rings.mkdir(mode=0o700)
        if shared_group is not None:
            os.chown(self.rings, 0, shared_group)
            self.rings.chmod(0o3770)
        self.volume.chmod(0o755)
        self.db_path = base / "memwatch.db"
        self.sides: list[Side] = []

    def view(self, name: str) -> Path:
        """An empty directory where one container sees the volume."""
        path = self.base / f"view-{name}"
        path.mkdir(exist_ok=True)
        path.chmod(0o755)
        return path

    def _rings_for(self, shape: Shape, name: str) -> tuple[Path, Path]:
        view = self.view(name)
        return view, (view / "rings" if shape.pid_ns else self.rings)

    def sidecar(self, shape: Shape = Shape(), *args: str, name: str = "sidecar") -> Side:
        view, rings = self._rings_for(shape, name)
        env = memwatch_env(rings, self.db_path)
        side = Side([sys.executable, "-m", "memwatch", "serve", "--poll-interval", "0.1", *args],
                    shape, self.volume, view, env)
        self.sides.append(side)
        # its pid file where the runtime directory is its state directory; its presence marker in a shared one
        wait_for(lambda: (self.rings / "sidecar.pid").exists() or (self.rings / "sidecar.present").exists()
                 or side.proc.poll() is not None, what="the sidecar's pid file")
        assert side.proc.poll() is None, side.finish()
        return side

    def engine(self, shape: Shape = Shape(), *, run_id: str, steps: int, pause: float = 0.0005,
               name: str = "engine") -> Side:
        view, rings = self._rings_for(shape, name)
        script = ENGINE.format(tests=TESTS, steps=steps, pause=pause, run_id=run_id)
        env = memwatch_env(rings, self.db_path, PYTHONDONTWRITEBYTECODE="1")
        side = Side([sys.executable, "-c", script], shape, self.volume, view, env)
        self.sides.append(side)
        readable, _, _ = select.select([side.proc.stdout], [], [], 30)  # bounded: a stuck start fails the test
        line = side.proc.stdout.readline() if readable else "no output within 30 s\n"  # "ready PID": the ring exists
        assert line.startswith("ready"), line + side.finish()[1]
        return side

    def close(self) -> None:
        for side in self.sides:
            side.kill()


def wait_until(predicate: object, timeout: float, what: str) -> float:
    """Wait for ``predicate`` (a callable); return the seconds it took."""
    started = time.monotonic()
    wait_for(predicate, timeout=timeout, what=what)  # type: ignore[arg-type]
    return time.monotonic() - started
