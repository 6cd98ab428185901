"""podman with the project's own settings and storage, and the base image it builds from Debian packages.

Everything lives under one cache directory outside the clone (``MEMWATCH_PODMAN_CACHE``, default
``/var/cache/memwatch-podman``): podman's ``--root``/``--runroot`` storage and a lock. The system's podman
storage and configuration are never used: ``CONTAINERS_CONF`` names ``containers.conf`` beside this file.
The base image (debootstrap's minimal bookworm with Python, curl and the CA bundle, imported with a PATH)
is tagged with a hash of its recipe, so it is built once per machine and again only when the recipe changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent.parent
CONF = HERE / "containers.conf"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEBOOTSTRAP = ["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates,curl", "bookworm"]
IMPORT_CHANGES = [f"ENV PATH={SYSTEM_PATH}"]
BASE_RECIPE = hashlib.sha256(repr((DEBOOTSTRAP, IMPORT_CHANGES)).encode()).hexdigest()[:12]
BASE_IMAGE = f"localhost/memwatch-base:{BASE_RECIPE}"
timings: dict[str, float] = {}  # phase -> seconds, for the measurements printed at the end of a test run


def cache_dir() -> Path:
    return Path(os.environ.get("MEMWATCH_PODMAN_CACHE", "/var/cache/memwatch-podman"))


class PodmanError(RuntimeError):
    """A podman command failed; the message holds its command line and output."""


class Podman:
    """``podman`` run against the cache's storage with the project's containers.conf; every call bounded."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        cache.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "CONTAINERS_CONF": str(CONF), "TMPDIR": str(cache / "tmp")}
        (cache / "tmp").mkdir(exist_ok=True)

    def argv(self, *args: str) -> list[str]:
        return ["podman", "--root", str(self.cache / "storage"), "--runroot", str(self.cache / "runroot"),
                "--storage-driver", "overlay", *args]

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            done = subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise PodmanError(f"podman {' '.join(args)}: no answer within {timeout} s") from exc
        if check and done.returncode != 0:
            raise PodmanError(f"podman {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def exists(self, image: str) -> bool:
        return self.run("image", "exists", image, check=False, timeout=30).returncode == 0

    @contextmanager
    def locked(self) -> Iterator[None]:
        """One builder at a time per cache (two clones may test on one machine)."""
        with open(self.cache / "lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield


@contextmanager
def timed(phase: str) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        timings[phase] = round(time.monotonic() - start, 1)


def ensure_base(podman: Podman) -> str:
    """The base image's name, built (debootstrap, then ``podman import``) when the cache lacks it."""
    if podman.exists(BASE_IMAGE):
        return BASE_IMAGE
    scratch = Path(tempfile.mkdtemp(prefix="rootfs-", dir=podman.cache / "tmp"))
    try:
        with timed("debootstrap"):
            done = subprocess.run([*DEBOOTSTRAP, str(scratch / "rootfs")], capture_output=True, text=True,
                                  timeout=600)
            if done.returncode != 0:
                raise PodmanError(f"debootstrap exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        with timed("import"):
            changes = [arg for change in IMPORT_CHANGES for arg in ("--change", change)]
            tar = subprocess.Popen(["tar", "-C", str(scratch / "rootfs"), "-c", "."], stdout=subprocess.PIPE)
            try:
                done = subprocess.run(podman.argv("import", *changes, "-", BASE_IMAGE), stdin=tar.stdout,
                                      env=podman.env, capture_output=True, text=True, timeout=300)
            finally:
                tar.kill()
                tar.wait(timeout=30)
                if tar.stdout is not None:
                    tar.stdout.close()
            if done.returncode != 0:
                raise PodmanError(f"podman import exited {done.returncode}: {done.stderr}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return BASE_IMAGE


def containers_refused(podman: Podman, base: str) -> str | None:
    """Why containers cannot run here (None when they can): ``true`` run once in the base image."""
    done = podman.run("run", "--rm", "--network", "none", base, "true", check=False, timeout=120)
    if done.returncode != 0:
        return f"the kernel or the sandbox refuses containers: {(done.stderr or done.stdout).strip()[-300:]}"
    return None
