"""memwatch in containers: engine and sidecar in pid, mount and user namespaces of their own, as other uids.

Each shape runs the real ``memwatch serve`` and a real Monitor writing a real ring into a shared
directory (the volume), and checks that every sample is stored exactly once and that the run ends
with the right status.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pods import Pod, Shape, namespaces_refused, wait_until

from memwatch.sidecar.collector import ALIVE_CHECK_S

from processes import query

REFUSED = namespaces_refused()
pytestmark = pytest.mark.skipif(REFUSED is not None, reason=REFUSED or "")

OWN_NS = Shape(pid_ns=True)
NOBODY = 65534


@pytest.fixture
def pod() -> Iterator[Pod]:
    base = Path(tempfile.mkdtemp(prefix="memwatch-pod-", dir="/tmp"))
    pod = Pod(base)
    try:
        yield pod
    finally:
        pod.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def shared_pod() -> Iterator[Pod]:
    """A runtime directory shared by group 65534: mode 3770, owned by root."""
    base = Path(tempfile.mkdtemp(prefix="memwatch-pod-", dir="/tmp"))
    pod = Pod(base, shared_group=NOBODY)
    try:
        yield pod
    finally:
        pod.close()
        shutil.rmtree(base, ignore_errors=True)


def _stored(pod: Pod, run_id: str) -> tuple[int, int]:
    """(decode samples stored, distinct decode steps among them) of the run."""
    rows = query(pod.db_path, "SELECT count(*), count(DISTINCT step) FROM samples WHERE run_id = ? AND "
                 "step_kind = 'decode'", (run_id,))
    return rows[0] if rows else (0, 0)


def _status(pod: Pod, run_id: str) -> tuple[str, str, int] | None:
    rows = query(pod.db_path, "SELECT r.status, k.status, k.lost_records FROM runs r JOIN ranks k USING (run_id) "
                 "WHERE run_id = ?", (run_id,))
    return rows[0] if rows else None


def _run_and_check(pod: Pod, engine_shape: Shape, sidecar_shape: Shape, steps: int, run_id: str,
                   *sidecar_args: str) -> None:
    sidecar = pod.sidecar(sidecar_shape, *sidecar_args)
    engine = pod.engine(engine_shape, run_id=run_id, steps=steps)
    rc, output = engine.finish()
    assert rc == 0 and "done" in output, output
    wait_until(lambda: _status(pod, run_id) is not None and _status(pod, run_id)[0] != "running", 30,
               "the run to end")
    sidecar.signal(signal.SIGTERM)
    rc, output = sidecar.finish()
    assert _status(pod, run_id) == ("ok", "ok", 0), output
    assert _stored(pod, run_id) == (steps, steps)
    assert rc == 0, output


def test_an_engine_in_its_own_pid_namespace_is_stored_whole_and_ends_ok(pod: Pod) -> None:
    # The sidecar cannot see the engine's pid (1 in its namespace, and pid 1 here is another process).
    _run_and_check(pod, OWN_NS, Shape(), 1500, "ownns")


def test_a_sidecar_in_its_own_pid_and_user_namespace_stores_an_engine_outside(pod: Pod) -> None:
    _run_and_check(pod, Shape(), Shape(pid_ns=True, user_ns=True), 800, "sidecarns")


def test_engine_and_sidecar_each_in_a_namespace_of_their_own(pod: Pod) -> None:
    _run_and_check(pod, OWN_NS, Shape(pid_ns=True, user_ns=True), 800, "bothns")


def test_a_root_sidecar_trusting_uid_65534_stores_its_engine_in_a_shared_group_directory(shared_pod: Pod) -> None:
    engine = Shape(pid_ns=True, uid=NOBODY, gid=NOBODY)
    _run_and_check(shared_pod, engine, Shape(pid_ns=True), 800, "nobody", "--trust-uid", str(NOBODY))
    assert not list(shared_pod.rings.glob("*.ring"))  # removed once stored (root may, in the sticky directory)


def test_an_untrusted_uid_is_refused_with_a_line_naming_it_and_the_option(shared_pod: Pod) -> None:
    sidecar = shared_pod.sidecar(Shape())
    engine = shared_pod.engine(Shape(uid=NOBODY, gid=NOBODY), run_id="untrusted", steps=50)
    assert engine.finish()[0] == 0
    ring = shared_pod.rings / "untrusted-r0.ring"
    assert ring.stat().st_uid == NOBODY and ring.stat().st_gid == NOBODY and ring.stat().st_mode & 0o777 == 0o640
    sidecar.signal(signal.SIGTERM)
    rc, output = sidecar.finish()
    assert rc == 0
    assert f"owned by uid {NOBODY}, which this sidecar does not trust" in output
    assert f"memwatch serve --trust-uid {NOBODY}" in output
    assert _status(shared_pod, "untrusted") is None and ring.exists()


def test_an_engine_sigkilled_in_its_namespace_ends_crashed_within_the_liveness_interval(pod: Pod) -> None:
    pod.sidecar(Shape())
    engine = pod.engine(OWN_NS, run_id="killed", steps=-1, pause=0.002)
    wait_until(lambda: _stored(pod, "killed")[0] >= 200, 30, "samples stored while the engine runs")
    assert _status(pod, "killed")[0] == "running"  # alive, though its pid is not ours to see
    engine.signal(signal.SIGKILL)
    took = wait_until(lambda: _status(pod, "killed")[0] == "crashed", 10, "the run marked crashed")
    count, distinct = _stored(pod, "killed")
    assert count == distinct and count >= 200
    # The writer is checked once a second when caught up; the sidecar polls every 0.1 s.
    assert took <= ALIVE_CHECK_S + 1.0, took
    print(f"crashed {took:.2f} s after SIGKILL")


def test_a_sidecar_restarted_mid_run_stores_every_sample_once(pod: Pod) -> None:
    first = pod.sidecar(OWN_NS, name="first")
    engine = pod.engine(OWN_NS, run_id="restart", steps=1200, pause=0.002)
    wait_until(lambda: _stored(pod, "restart")[0] >= 100, 30, "the first sidecar storing")
    first.signal(signal.SIGTERM)  # pid 1 of its namespace: the handler still runs and drains
    assert first.finish()[0] == 0
    wait_until(lambda: not (pod.rings / "sidecar.pid").exists(), 10, "the first sidecar gone")
    pod.sidecar(OWN_NS, name="second")
    assert engine.finish()[0] == 0
    wait_until(lambda: (_status(pod, "restart") or ("",))[0] == "ok", 30, "the run to end")
    assert _status(pod, "restart") == ("ok", "ok", 0)
    assert _stored(pod, "restart") == (1200, 1200)


def test_sigterm_drains_every_ring_before_the_sidecar_exits(pod: Pod) -> None:
    sidecar = pod.sidecar(OWN_NS)
    sidecar.signal(signal.SIGSTOP)  # it cannot read while the engines write
    for run_id in ("drain-a", "drain-b"):
        assert pod.engine(OWN_NS, run_id=run_id, steps=600, pause=0, name=run_id).finish()[0] == 0
    sidecar.signal(signal.SIGTERM)
    sidecar.signal(signal.SIGCONT)
    rc, output = sidecar.finish()
    assert rc == 0, output
    for run_id in ("drain-a", "drain-b"):
        assert _stored(pod, run_id) == (600, 600)
        assert _status(pod, run_id) == ("ok", "ok", 0)
    assert not list(pod.rings.glob("*.ring"))


def test_an_agent_that_does_not_own_the_shared_directory_stores_once_and_says_why_rings_stay(
        shared_pod: Pod) -> None:
    # A non-root agent in the group, not the directory's owner: the sticky bit keeps it from removing rings.
    shared_pod.base.chmod(0o1777)  # its database lives beside the volume
    agent = Shape(pid_ns=True, uid=1000, gid=NOBODY)
    sidecar = shared_pod.sidecar(agent, "--trust-uid", str(NOBODY))
    engine = shared_pod.engine(Shape(pid_ns=True, uid=NOBODY, gid=NOBODY), run_id="stays", steps=300)
    assert engine.finish()[0] == 0
    wait_until(lambda: (_status(shared_pod, "stays") or ("",))[0] == "ok", 30, "the run to end")
    time.sleep(1.0)  # several scans of the directory with the stored ring still in it
    sidecar.signal(signal.SIGTERM)
    rc, output = sidecar.finish()
    assert rc == 0, output
    assert _stored(shared_pod, "stays") == (300, 300)
    assert output.count("cannot remove the stored ring") == 1, output
    assert (shared_pod.rings / "stays-r0.ring").exists()
