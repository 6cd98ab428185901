"""The sidecar bundles a run that runs out of memory, one that crashes, and the runs still active at SIGTERM.

Real processes throughout: ``memwatch serve`` with ``MEMWATCH_BUNDLE_DIR`` set, and ``memwatch sim`` engines writing
real rings; the out-of-memory run ends by itself, the crashed one is SIGKILLed, and the pod shutdown is the
sidecar's SIGTERM while an engine is still serving. Each gives exactly one bundle, named for its run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memwatch.incident import manifest as m
from memwatch.incident.open import load
from memwatch.incident.triggers import FLAG_SETTLE_S

from processes import SidecarProcess, memwatch_env, query, wait_for


@pytest.fixture
def bundles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "bundles"
    monkeypatch.setenv("MEMWATCH_BUNDLE_DIR", str(folder))  # the sidecar started next inherits it
    return folder


def _bundles(folder: Path) -> list[Path]:
    return sorted(folder.glob("memwatch-incident-*.tar.gz")) if folder.exists() else []


def _sim(runtime_dir: Path, db_path: Path, scenario: str, *speed: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "memwatch", "sim", "--scenario", scenario, *speed],
                            env=memwatch_env(runtime_dir, db_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _serving(db_path: Path, samples: int = 30) -> bool:
    return bool(query(db_path, "SELECT 1 FROM samples WHERE phase = 'serve' LIMIT 1 OFFSET ?", (samples,)))


def test_an_out_of_memory_run_gives_one_bundle(runtime_dir: Path, db_path: Path, bundles: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        engine = _sim(runtime_dir, db_path, "long_prefill")
        assert engine.wait(120) == 0
        [path] = wait_for(lambda: _bundles(bundles), timeout=30, what="the OOM's bundle")
        # oom_risk and oom are critical flags of the same run: past their settling time, still one bundle.
        time.sleep(FLAG_SETTLE_S + 1)
        assert _bundles(bundles) == [path]
        output = sidecar.stop()
    manifest, members = load(path.read_bytes())
    [(run_id,)] = query(db_path, "SELECT run_id FROM runs")
    assert (manifest.run_id, manifest.trigger, manifest.verdict) == (run_id, "oom", "oom")
    assert path.name.endswith(f"-{run_id}.tar.gz")
    assert b"[oom]" in members[m.LOG]  # the sidecar's own log line of the flag, in its tail
    assert f"incident bundle {path.name} (oom" in output


def test_a_crashed_run_gives_one_bundle(runtime_dir: Path, db_path: Path, bundles: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        engine = _sim(runtime_dir, db_path, "clean_chat", "--speed", "2")
        try:
            wait_for(lambda: _serving(db_path), timeout=60, what="the engine to serve")
        finally:
            engine.send_signal(signal.SIGKILL)
            engine.wait(10)
        [path] = wait_for(lambda: _bundles(bundles), timeout=30, what="the crash's bundle")
        sidecar.stop()
    manifest, _ = load(path.read_bytes())
    assert (manifest.trigger, manifest.verdict) == ("crashed", "crashed")
    assert _bundles(bundles) == [path]


def test_sigterm_with_an_active_ring_gives_one_bundle_within_the_grace_period(
        runtime_dir: Path, db_path: Path, bundles: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        engine = _sim(runtime_dir, db_path, "clean_chat", "--speed", "1")
        try:
            wait_for(lambda: _serving(db_path), timeout=60, what="the engine to serve")
            assert _bundles(bundles) == []
            started = time.monotonic()
            output = sidecar.stop(timeout=30)
            took = time.monotonic() - started
        finally:
            engine.kill()
            engine.wait(10)
    [path] = _bundles(bundles)
    manifest, _ = load(path.read_bytes())
    [(run_id, status)] = query(db_path, "SELECT run_id, status FROM runs")
    assert (manifest.run_id, manifest.trigger, status) == (run_id, "shutdown", "running")
    assert f"incident bundle {path.name} (shutdown" in output
    # Kubernetes' default grace period is 30 s; the last drain, commit and bundle took this long here.
    assert took < 30, took
    print(f"SIGTERM to exit, bundle included: {took:.2f} s")
