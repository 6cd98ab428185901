"""A crashed run's bundle is never lost before the spool: real sidecars as a pod runs them, real crashed engines.

Each sidecar runs in a mount namespace where ``/tmp`` and ``/var/tmp`` are read-only and ``TMPDIR`` names nothing
(a pod's ``readOnlyRootFilesystem`` with no ``/tmp`` volume): the bundle is built in its state directory. A sidecar
SIGKILLed in the middle of a build leaves the bundle owed in the database; the next one removes the partial work
and ships the bundle, once. A full state volume (a small tmpfs) fails the build; once space is back the bundle is
built and shipped, without a restart.
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path

import pytest
from incident_sidecars import PodSidecar, bundles_in, crash_an_engine, namespaces_or_skip

from memwatch.incident.open import load

from processes import query, wait_for
from ship_s3 import S3Server, free_port


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    namespaces_or_skip()


def _dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    runtime, shipped = tmp_path / "rt", tmp_path / "shipped"
    runtime.mkdir(mode=0o700)
    shipped.mkdir()
    return runtime, tmp_path / "memwatch.db", shipped


def test_a_sidecar_without_a_usable_tmpdir_builds_and_ships_a_crashed_runs_bundle(tmp_path: Path) -> None:
    runtime, db_path, shipped = _dirs(tmp_path)
    with PodSidecar(runtime, db_path, "--bundle-to", str(shipped), writable=(tmp_path,)) as sidecar:
        run_id = crash_an_engine(runtime, db_path)
        [name] = wait_for(lambda: bundles_in(shipped), timeout=60, what="the crash's bundle shipped")
        out = sidecar.stop()
    manifest, _ = load((shipped / name).read_bytes())
    assert (manifest.run_id, manifest.trigger, manifest.verdict) == (run_id, "crashed", "crashed")
    assert "could not be built" not in out, out
    assert query(db_path, "SELECT trigger, state, bundle FROM incidents") == [("crashed", "built", name)]
    assert bundles_in(runtime / "incidents") == bundles_in(runtime / "bundles") == []


def _pause_mid_build(sidecar: PodSidecar, build_dir: Path) -> None:
    """SIGSTOP the sidecar as soon as a build's work folder exists (polled every millisecond)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if build_dir.exists() and any(p.name.startswith(".work-") for p in build_dir.iterdir()):
            sidecar.proc.send_signal(signal.SIGSTOP)
            return
        time.sleep(0.001)
    raise AssertionError("no build began within 60 s")


@pytest.mark.parametrize("store", ["folder", "s3"])
def test_a_sidecar_killed_mid_build_ships_the_bundle_once_after_a_restart(tmp_path: Path, store: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, db_path, shipped = _dirs(tmp_path)
    build_dir = runtime / "incidents"
    server, bucket = None, f"bundles-{uuid.uuid4().hex[:12]}"
    dest = str(shipped)
    if store == "s3":
        server = S3Server(free_port()).start()
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        server.client().create_bucket(Bucket=bucket)
        dest = f"s3://{bucket}/incidents"

    def keys() -> list[str]:
        if server is None:
            return bundles_in(shipped)
        return [key.rsplit("/", 1)[1] for key in server.keys(bucket)]

    try:
        with PodSidecar(runtime, db_path, "--bundle-to", dest, writable=(tmp_path,)) as first:
            run_id = crash_an_engine(runtime, db_path)
            _pause_mid_build(first, build_dir)
            [(state, name)] = query(db_path, "SELECT state, bundle FROM incidents")
            assert state == "building" and name.endswith(f"-{run_id}.tar.gz")  # named before it is built
            first.kill()
        leftovers = [p.name for p in build_dir.iterdir()]
        assert any(n.startswith(".work-") for n in leftovers) and keys() == [], leftovers

        with PodSidecar(runtime, db_path, "--bundle-to", dest, writable=(tmp_path,)) as second:
            wait_for(lambda: keys(), timeout=60, what="the owed bundle shipped after the restart")
            time.sleep(3)  # a few rounds more: nothing built or shipped twice
            out = second.stop()
        assert keys() == [name], out
        assert [p.name for p in build_dir.iterdir()] == [] and bundles_in(runtime / "bundles") == []
        assert query(db_path, "SELECT state, bundle FROM incidents") == [("built", name)]
        assert "removed 1 leftover(s) of bundle builds cut short" in out, out
        data = (shipped / name).read_bytes() if server is None else server.client().get_object(
            Bucket=bucket, Key=f"incidents/{name}")["Body"].read()
        assert load(data)[0].trigger == "crashed"
    finally:
        if server is not None:
            server.stop()


def test_a_full_state_volume_delays_the_bundle_until_space_is_back(tmp_path: Path) -> None:
    runtime, db_path, shipped = _dirs(tmp_path)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with PodSidecar(runtime, db_path, "--bundle-to", str(shipped), "--state-dir", str(state), writable=(tmp_path,),
                    tmpfs=(state, 1 << 20)) as sidecar:
        filled = sidecar.inside(f"dd if=/dev/zero of={state}/filler bs=4k 2>&1; sync")
        assert "No space left on device" in filled.stdout, filled
        run_id = crash_an_engine(runtime, db_path)
        wait_for(lambda: query(db_path, "SELECT 1 FROM incidents"), timeout=30, what="the bundle decided")
        time.sleep(4)  # tries at once, after 1 s and 2 s: each fails
        assert bundles_in(shipped) == []
        assert query(db_path, "SELECT state FROM incidents")[0][0] in ("owed", "building")
        sidecar.inside(f"rm {state}/filler")
        [name] = wait_for(lambda: bundles_in(shipped), timeout=60, what="the bundle once space is back")
        out = sidecar.stop()
    assert "No space left on device" in out or "disk is full" in out, out
    assert load((shipped / name).read_bytes())[0].run_id == run_id
    assert query(db_path, "SELECT state FROM incidents") == [("built",)]
