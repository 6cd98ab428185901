"""A small, private tmpfs for one child process: a full runtime or database filesystem, for real.

The child runs in its own mount namespace (``unshare``), so the mount needs no cleanup and never
touches the machine's filesystems. As root that needs only ``--mount``; otherwise a user namespace.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent.parent)


def unshare_prefix() -> list[str]:
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is missing: no way to mount a private small filesystem here")
    prefix = ["unshare", "--mount", "--propagation", "private"]
    if os.getuid() != 0:
        prefix[1:1] = ["--user", "--map-root-user"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.strip()}")
    return prefix


def run_in_small_fs(mount_at: Path, size: str, script: str, *, env: dict[str, str] | None = None,
                    timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (Python) with a ``size`` tmpfs mounted at ``mount_at`` (mode 0700)."""
    mount_at.mkdir(mode=0o700, exist_ok=True)
    shell = (f"mount -t tmpfs -o size={size},mode=0700 tmpfs {shlex.quote(str(mount_at))} && "
             f"exec {shlex.quote(sys.executable)} -c {shlex.quote(script)}")
    return subprocess.run([*unshare_prefix(), "sh", "-c", shell], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
