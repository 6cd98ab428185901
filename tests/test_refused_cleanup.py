"""Refused rings do not stay on the node for ever: removed once old and unwritten, where the sidecar may.

Real uids (``setpriv``) in a shared runtime directory (mode 3770, root:50000): uid 50001 is an untrusted
member that leaves a finished 8 MiB ring, an empty name and a ring its live engine still holds; the sidecar's
finder refuses them all. Root, the directory's owner, removes the two nobody writes once they are past the
bound; a sidecar of another uid may not remove another user's file in a sticky directory, and says so once.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memwatch.sidecar.refused_cleanup import KEEP_S, RefusedCleanup
from memwatch.sidecar.ring_finder import RingFinder

pytestmark = pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                                reason="an untrusted uid's rings need root and setpriv (util-linux)")

GROUP, ATTACKER, ENGINE = 50000, 50001, 65534
RINGS = """
import os, sys
from memwatch_engine.ring import RingWriter
META = {"engine": "vllm", "model": "m", "gpu_name": "H100", "gpu_total_bytes": 80 * 2**30, "pid": 7,
        "device_index": 0, "config": {}, "source": "engine"}
RingWriter("old-r0.ring", run_id="old", meta=META, capacity=65536, mode=0o640).close()
os.close(os.open("junk.ring", os.O_CREAT | os.O_WRONLY, 0o640))
live = RingWriter("live-r0.ring", run_id="live", meta=META, capacity=256, mode=0o640)
print("written", flush=True)
sys.stdin.read()
live.close()
"""
AS_OTHER_SIDECAR = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from pathlib import Path
from memwatch.sidecar.refused_cleanup import RefusedCleanup
from memwatch.sidecar.ring_finder import RingFinder
finder = RingFinder(Path(sys.argv[1]))
print(list(finder.listing()))
cleanup = RefusedCleanup(finder, clock=lambda: time.time() + 7200)
print(cleanup.sweep(), cleanup.kept)
cleanup.sweep()
"""


@pytest.fixture
def rings() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="memwatch-refused-", dir="/tmp"))
    try:
        base.chmod(0o711)
        rings = base / "rings"
        rings.mkdir()
        os.chown(rings, 0, GROUP)
        rings.chmod(0o3770)
        yield rings
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _as(uid: int, code: str, *args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={GROUP}", f"--groups={GROUP}", sys.executable,
                             "-c", code, *args], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


@pytest.fixture
def attacker(rings: Path) -> Iterator[subprocess.Popen[str]]:
    writer = _as(ATTACKER, RINGS, cwd=rings)
    assert writer.stdout is not None and writer.stdout.readline().strip() == "written"
    yield writer
    assert writer.stdin is not None
    writer.stdin.close()
    writer.wait(timeout=30)
    writer.stdout.close()


def test_root_removes_the_refused_rings_nobody_writes_once_past_the_bound(
        rings: Path, attacker: subprocess.Popen[str], caplog: pytest.LogCaptureFixture) -> None:
    assert (rings / "old-r0.ring").stat().st_size > 8 * 2**20  # what a node's disk kept for ever
    finder = RingFinder(rings, trust=[ENGINE])
    try:
        assert list(finder.listing()) == []
        assert finder.refused.counts()["untrusted_uid"] == 3
        young = RefusedCleanup(finder)
        assert young.sweep() == 0 and young.kept == 0  # just written: kept (their engine may start late)
        now = time.time()
        cleanup = RefusedCleanup(finder, clock=lambda: now + KEEP_S + 1)
        with caplog.at_level(logging.INFO, logger="memwatch.collector"):
            assert cleanup.sweep() == 2
        assert sorted(path.name for path in rings.iterdir()) == ["live-r0.ring"]  # its writer holds its lock
        assert cleanup.removed == 2 and cleanup.kept == 0
        assert finder.refused.counts()["untrusted_uid"] == 1
        assert "removed 2 refused rings unchanged for 3600 s with no writer" in caplog.text
    finally:
        finder.close()


def test_a_sidecar_that_may_not_remove_them_keeps_them_counted_and_says_so_once(
        rings: Path, attacker: subprocess.Popen[str]) -> None:
    other = _as(ENGINE, AS_OTHER_SIDECAR, str(rings), cwd=rings.parent)
    output, _ = other.communicate(timeout=60)
    assert other.returncode == 0, output
    printed = [line for line in output.splitlines() if not line.startswith(("WARNING ", "INFO "))]
    assert printed == ["[]", "0 2"], output  # nothing taken; the two past the bound not permitted
    assert output.count("2 refused rings cannot be removed from") == 1, output  # once, not at every sweep
    assert sorted(path.name for path in rings.iterdir()) == ["junk.ring", "live-r0.ring", "old-r0.ring"]


def test_rings_it_may_not_remove_are_counted_said_once_and_sweeps_come_when_due(
        rings: Path, attacker: subprocess.Popen[str], caplog: pytest.LogCaptureFixture) -> None:
    # Root may remove anything but from an immutable directory (chattr +i): the refusal a sidecar of another
    # uid meets in a sticky directory, here in this process.
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr (e2fsprogs)")
    finder = RingFinder(rings, trust=[ENGINE])
    now = [time.time() + KEEP_S + 1]
    cleanup = RefusedCleanup(finder, every_s=300, clock=lambda: now[0])
    try:
        assert list(finder.listing()) == []
        subprocess.run(["chattr", "+i", str(rings)], check=True, timeout=30)
        try:
            with caplog.at_level(logging.INFO, logger="memwatch.collector"):
                cleanup.tick()
                assert cleanup.kept == 0 and "cannot be removed" not in caplog.text  # not due yet
                now[0] += 300
                cleanup.tick()
                assert (cleanup.removed, cleanup.kept) == (0, 2)
                now[0] += 300
                cleanup.tick()
                assert (cleanup.removed, cleanup.kept) == (0, 2)
        finally:
            subprocess.run(["chattr", "-i", str(rings)], check=True, timeout=30)
        said = [r.getMessage() for r in caplog.records if "cannot be removed" in r.getMessage()]
        assert said == [f"2 refused rings cannot be removed from {rings}: only the directory's owner (or root) may "
                        "remove another user's file there; they stay, counted by memwatch_rings_refused, until "
                        "their owner removes them"]  # once, at the first sweep that met them
        with caplog.at_level(logging.INFO, logger="memwatch.collector"):
            assert cleanup.sweep() == 2 and (cleanup.removed, cleanup.kept) == (2, 0)
        assert sorted(path.name for path in rings.iterdir()) == ["live-r0.ring"]  # its writer still holds it
        assert caplog.records[-1].getMessage() == "removed 2 refused rings unchanged for 3600 s with no writer"
    finally:
        finder.close()
