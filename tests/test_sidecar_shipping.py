"""The sidecar's bundles in process: the build folder it may use, the spool and shipper started and stopped, the
counts and the "overdue" answer /readyz gives, and the grace period shared by the last builds and uploads.

Real folders, a real copy of a stored run's database (the simulator's ``long_prefill``, ended ``oom``), real
threads; the stores are a local folder, one a regular file stands in the way of (every upload fails), and a socket
that accepts and never answers (every upload hangs).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_incident_ship import make_bundle
from test_incident_trigger_rules import _sql, copy_of

from memwatch.detectors import DetectorConfig
from memwatch.errors import PermissionDeniedError
from memwatch.export.config import ExportConfig
from memwatch.export.pipeline import Exporters
from memwatch.flags import CRITICAL, Flag
from memwatch.incident import manifest as m
from memwatch.incident import spool
from memwatch.incident.open import load
from memwatch.sidecar.shipping import BundleSettings, Incidents, Shipping, open_build_dir
from memwatch.store import open_store
from memwatch_engine.dirfd import private_dir

from processes import wait_for
from ship_s3 import CREDENTIALS


@pytest.fixture
def state(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    fd = private_dir(tmp_path / "state")
    yield fd, tmp_path / "state"
    os.close(fd)


@pytest.fixture
def quiet_db(long_prefill_stored: tuple[Path, str], tmp_path: Path) -> tuple[Path, str]:
    """A copy of the stored run with no bundle owed: the builder has nothing to do until told."""
    path = copy_of(long_prefill_stored[0], tmp_path / "memwatch.db")
    _sql(path, "DELETE FROM incidents")
    return path, long_prefill_stored[1]


def _incidents(settings: BundleSettings, db_path: Path, state: tuple[int, Path],
               exporters: Exporters | None = None, detector_config: DetectorConfig | None = None) -> Incidents:
    db = open_store(db_path)
    db.conn.close()
    return Incidents(settings, db_path=db_path, writer=None, detector_config=detector_config,  # type: ignore[arg-type]
                     state_fd=state[0], state_dir=state[1], exporters=exporters)


def _close(incidents: Incidents, active: set[str] | None = None) -> None:
    incidents.close_triggers(active or set())
    incidents.close_shipping()


def _fds(below: Path) -> set[str]:
    """What this process holds open below ``below`` (the store's own runtime holds descriptors of its own)."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{below}/"):
            held.add(f"{fd} {target}")
    return held


def _overdue_says(incidents: Incidents, bound_s: float, since_ns: int, text: str) -> None:
    """``overdue(bound_s)`` says ``text`` (with ``{}`` for the whole seconds waited since ``since_ns``)."""
    before = time.time_ns()
    said = incidents.overdue(bound_s)
    after = time.time_ns()
    assert said in {text.format(f"{(now - since_ns) / 1e9:.0f}") for now in (before, after)}, said


def _blocked(tmp_path: Path) -> str:
    """A folder URL below a regular file: every upload there fails (not a directory), nothing is refused."""
    (tmp_path / "a-file").write_bytes(b"")
    return f"file://{tmp_path}/a-file/shipped"


def _spooled_by_hand(incidents: Incidents, tmp_path: Path, age_s: float, run: str = "run1") -> tuple[str, int]:
    """A bundle written ``age_s`` ago, handed to the spool as the builder hands its own; its name and size."""
    path = make_bundle(tmp_path / "built", run=run)
    then = time.time_ns() - int(age_s * 1e9)
    os.utime(path, ns=(then, then))
    size = path.stat().st_size
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert incidents.shipping is not None
        incidents.shipping.enqueue_from(fd, path.name)
    finally:
        os.close(fd)
    return path.name, size


def test_the_settings_take_the_build_folder_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("MEMWATCH_BUNDLE_DIR", str(tmp_path / "b"))
    made = BundleSettings.from_env("s3://x/y", tmp_path / "log", per_hour=3, grace_s=12.5, spool_count=2)
    assert made == BundleSettings("s3://x/y", tmp_path / "b", tmp_path / "log", per_hour=3, grace_s=12.5,
                                  spool_count=2)
    monkeypatch.setenv("MEMWATCH_BUNDLE_DIR", "")
    assert BundleSettings.from_env("", None) == BundleSettings(None, None, None)
    monkeypatch.delenv("MEMWATCH_BUNDLE_DIR")
    assert BundleSettings.from_env() == BundleSettings()


def test_the_build_folder_is_made_private_and_one_others_control_is_refused(tmp_path: Path) -> None:
    fd = open_build_dir(tmp_path / "made" / "in" / "incidents")  # its parents made too
    try:
        assert os.fstat(fd).st_ino == (tmp_path / "made" / "in" / "incidents").stat().st_ino
        assert (tmp_path / "made" / "in").stat().st_mode & 0o7777 == 0o700
        assert (tmp_path / "made" / "in" / "incidents").stat().st_mode & 0o7777 == 0o700
    finally:
        os.close(fd)
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    os.chmod(readable, 0o755)
    os.close(open_build_dir(readable))  # others may read it, none may write it: fine
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    before = _fds(tmp_path)
    with pytest.raises(PermissionDeniedError) as refused:
        open_build_dir(shared)
    assert str(refused.value) == (f"MEMWATCH_BUNDLE_DIR {shared} can be written by other users (mode 775); bundles "
                                  "are built only in a folder of the sidecar's user that no other user can write "
                                  "(chown it, chmod 700)")
    assert _fds(tmp_path) == before
    if os.geteuid() == 0:
        os.chmod(shared, 0o700)
        os.chown(shared, 4242, 4242)
        with pytest.raises(PermissionDeniedError, match=rf"{shared} belongs to uid 4242, not 0; bundles are built"):
            open_build_dir(shared)
        assert _fds(tmp_path) == before
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(PermissionDeniedError) as refused:
        open_build_dir(tmp_path / "a-file")
    assert str(refused.value) == (f"MEMWATCH_BUNDLE_DIR {tmp_path}/a-file: Not a directory; give a folder of the "
                                  "sidecar's user")
    (tmp_path / "link").symlink_to(readable)
    with pytest.raises(PermissionDeniedError, match=r"MEMWATCH_BUNDLE_DIR .*/link: "):
        open_build_dir(tmp_path / "link")  # a link is never followed


def test_without_bundles_nothing_runs_and_the_grace_period_is_counted_from_the_last_round(
        quiet_db: tuple[Path, str], state: tuple[int, Path]) -> None:
    before = _fds(state[1].parent)
    incidents = _incidents(BundleSettings(termination_log=None, grace_s=30.0), quiet_db[0], state)
    assert (incidents.shipping, incidents.triggers, incidents.build_fd) == (None, None, -1)
    assert incidents.counts() == {"built": 0, "shipped": 0, "failed": 0, "dropped": 0, "spool_bytes": 0,
                                  "spool_bundles": 0}
    assert incidents.overdue(0.0) is None
    assert incidents.exit_margin_s == 6.0  # 5 s spare and 1 s to exit; no exporters to flush
    assert 23.9 < incidents.grace_left() <= 24.0  # before the loop's first round: from now
    incidents.tick()
    time.sleep(0.3)
    assert 22.0 < incidents.grace_left() <= 23.7  # from the round, however long ago
    _close(incidents)
    assert _fds(state[1].parent) == before
    with_exporters = _incidents(BundleSettings(termination_log=None), quiet_db[0], state, Exporters(ExportConfig()))
    assert with_exporters.exit_margin_s == 11.0  # and 5 s for the exporters' last flush
    _close(with_exporters)


def test_a_bundle_owed_is_built_beside_the_spool_shipped_and_counted(long_prefill_stored: tuple[Path, str],
                                                                     state: tuple[int, Path], tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    db_path = copy_of(long_prefill_stored[0], tmp_path / "memwatch.db")  # its oom bundle is owed
    dest = f"file://{tmp_path}/shipped"
    exporters = Exporters(ExportConfig())
    before = _fds(tmp_path)
    incidents = _incidents(BundleSettings(dest, termination_log=None), db_path, state, exporters)
    [name] = wait_for(lambda: os.listdir(tmp_path / "shipped") if (tmp_path / "shipped").is_dir() else [],
                      timeout=30, what="the bundle shipped")
    assert name.startswith("memwatch-incident-") and name.endswith(".tar.gz")
    assert (state[1] / "incidents").stat().st_mode & 0o7777 == 0o700  # built in the state folder, then renamed
    assert os.listdir(state[1] / "incidents") == [] and os.listdir(state[1] / "bundles") == []
    counts = wait_for(lambda: (c := incidents.counts())["shipped"] and c, what="the count")
    assert counts == {"built": 1, "shipped": 1, "failed": 0, "dropped": 0, "spool_bytes": 0, "spool_bundles": 0}
    assert exporters.state.bundle_counts() == counts  # what memwatch.bundles.* report
    assert incidents.overdue(0.0) is None
    caplog.set_level(logging.INFO, "memwatch.serve")
    incidents.close_triggers(set())
    assert incidents.build_fd == -1 and incidents.triggers is None
    incidents.close_shipping()
    assert incidents.shipping is None
    assert "shipping what is spooled within 19.0 s, what is left of the 30 s grace period" in caplog.messages
    assert _fds(tmp_path) == before


def test_a_bundle_the_store_cannot_take_waits_counted_and_is_overdue(quiet_db: tuple[Path, str],
                                                                    state: tuple[int, Path], tmp_path: Path) -> None:
    incidents = _incidents(BundleSettings(_blocked(tmp_path), termination_log=None), quiet_db[0], state)
    assert incidents.shipping is not None
    name, size = _spooled_by_hand(incidents, tmp_path, age_s=1000.0)
    counts = wait_for(lambda: (c := incidents.counts())["failed"] and c, timeout=10, what="a failed upload")
    assert counts == {"built": 0, "shipped": 0, "failed": 1, "dropped": 0, "spool_bytes": size, "spool_bundles": 1}
    written = (state[1] / "bundles" / name).stat().st_mtime_ns
    _overdue_says(incidents, 600.0, written, f"bundle {name} has waited {{}} s to be shipped")
    assert incidents.overdue(1001.0) is None
    shipping = incidents.shipping
    incidents.close_shipping()
    assert shipping.spool.fd < 0  # the thread ended: the spool is closed
    assert incidents.overdue(0.0) is None  # nothing is shipping any more
    incidents.close_triggers(set())


def test_a_bundle_owed_and_not_yet_built_is_overdue(quiet_db: tuple[Path, str], state: tuple[int, Path],
                                                    tmp_path: Path) -> None:
    # Its name is taken in the build folder by a folder: every try fails and it stays owed.
    db_path, run_id = quiet_db
    name = "memwatch-incident-20300101T000000Z-pod-x-taken.tar.gz"
    (tmp_path / "built" / name).mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "built", 0o700)
    decided = time.time_ns() - 1500 * 10**9
    _sql(db_path, "INSERT INTO incidents (run_id, trigger, decided_ns, state, bundle) VALUES (?, 'oom', ?, "
         "'building', ?)", (run_id, decided, name))
    incidents = _incidents(BundleSettings(build_dir=tmp_path / "built", termination_log=None), db_path, state)
    assert incidents.triggers is not None
    wait_for(lambda: incidents.triggers.oldest_owed is not None, what="the builder's first round")  # type: ignore[union-attr]
    _overdue_says(incidents, 600.0, decided, "an incident bundle has waited {} s to be built")
    assert incidents.overdue(1501.0) is None
    assert incidents.counts()["failed"] >= 1
    _close(incidents)


@pytest.mark.parametrize(("grace_s", "built"), [(9.0, 0), (60.0, 1)])
def test_the_shutdown_builds_only_within_the_grace_period_less_the_uploads_reserve(
        quiet_db: tuple[Path, str], state: tuple[int, Path], tmp_path: Path, grace_s: float, built: int) -> None:
    # 9 s less the 6 s kept for exiting leaves 3 s, all of it the uploads' reserve: no build begins.
    db_path, run_id = quiet_db
    incidents = _incidents(BundleSettings(build_dir=tmp_path / "built", termination_log=None, grace_s=grace_s),
                           db_path, state)
    incidents.tick()
    incidents.close_triggers({run_id})
    assert len(os.listdir(tmp_path / "built")) == built
    assert _sql(db_path, "SELECT trigger, state FROM incidents") == [("shutdown", "built" if built else "owed")]
    incidents.close_shipping()


def test_without_a_shutdown_nothing_is_owed_for_the_runs(quiet_db: tuple[Path, str], state: tuple[int, Path],
                                                         tmp_path: Path) -> None:
    incidents = _incidents(BundleSettings(build_dir=tmp_path / "built", termination_log=None), quiet_db[0], state)
    incidents.close_triggers(set())
    assert os.listdir(tmp_path / "built") == [] and _sql(quiet_db[0], "SELECT * FROM incidents") == []


def test_shipping_starts_at_once_takes_what_a_build_hands_it_and_stops_taking(state: tuple[int, Path],
                                                                              tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "memwatch.serve")
    dest = tmp_path / "shipped"
    log = tmp_path / "term"
    log.write_bytes(b"")
    before = _fds(tmp_path)
    shipping = Shipping(f"file://{dest}", state[0], state[1], None, log, rescan=60.0)  # no rescan in this test
    assert f"shipping incident bundles to file://{dest} (spool {state[1]}/bundles)" in caplog.messages
    first = make_bundle(tmp_path / "built", run="run1")
    spool.enqueue(first)  # what a bundle built anywhere in the process does
    wait_for(lambda: (dest / first.name).exists(), timeout=3, what="the upload, at once")
    assert log.read_text() == f"memwatch incident: oom (oom) file://{dest}/{first.name}\n"
    shipping.close(1.0)
    assert _fds(tmp_path) == before  # the spool, the termination log's folder
    second = make_bundle(tmp_path / "built", run="run2")
    spool.enqueue(second)
    assert second.exists()  # no sidecar shipping any more: it stays where it was built


def test_a_build_folder_others_may_enter_is_refused_and_nothing_is_left_open(quiet_db: tuple[Path, str],
                                                                             state: tuple[int, Path],
                                                                             tmp_path: Path) -> None:
    (state[1] / "incidents").mkdir(mode=0o755)
    os.chmod(state[1] / "incidents", 0o755)
    before = _fds(tmp_path)
    with pytest.raises(PermissionDeniedError) as refused:
        _incidents(BundleSettings(f"file://{tmp_path}/shipped", termination_log=None), quiet_db[0], state)
    assert str(refused.value) == (f"cannot build bundles in {state[1]}/incidents: mode 755 lets other users in; "
                                  "chmod 700 it; it must be a directory of the sidecar's user, mode 0700")
    assert _fds(tmp_path) == before
    os.chmod(state[1] / "incidents", 0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionDeniedError, match="--termination-log"):  # after the build folder was opened
        _incidents(BundleSettings(f"file://{tmp_path}/shipped", termination_log=shared / "log"), quiet_db[0], state)
    assert _fds(tmp_path) == before


def _hanging_store(monkeypatch: pytest.MonkeyPatch, hole: socket.socket) -> str:
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{hole.getsockname()[1]}"}.items():
        monkeypatch.setenv(key, value)
    return "s3://bundles/incidents"


@pytest.mark.parametrize(("grace_s", "budget"), [(7.5, "1.5"), (2.0, "0.0")])
def test_the_last_uploads_get_what_is_left_of_the_grace_period(quiet_db: tuple[Path, str], state: tuple[int, Path],
                                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture, grace_s: float,
                                                                budget: str) -> None:
    # The shipper's own try hangs (its budget is 30 s and more); the last pass skips it and waits for it no
    # longer than what is left: 7.5 s less the 6 s kept for exiting, or nothing once the grace period is spent.
    caplog.set_level(logging.INFO, "memwatch.serve")
    with socket.socket() as hole:
        dest = _hanging_store(monkeypatch, hole)
        incidents = _incidents(BundleSettings(dest, termination_log=None, grace_s=grace_s), quiet_db[0], state)
        shipping = incidents.shipping
        assert shipping is not None
        _spooled_by_hand(incidents, tmp_path, age_s=1.0)
        wait_for(lambda: shipping.shipper.attempts, timeout=5, what="the shipper's try")
        incidents.tick()
        start = time.monotonic()
        done = threading.Thread(target=incidents.close_shipping, daemon=True)
        done.start()
        done.join(float(budget) + 3.0)  # bounded: the shipper's own budget would be 30 s, the default 10 s
        took = time.monotonic() - start
        assert not done.is_alive()
        assert took < float(budget) + 2.0
        assert f"shipping what is spooled within {budget} s, what is left of the {grace_s:.0f} s grace period" in \
            caplog.messages
        assert shipping.spool.fd >= 0  # its try is still in flight on the thread: the spool stays open for it
        incidents.close_triggers(set())


def test_a_shipped_bundle_is_announced_on_the_exporters_log_records(quiet_db: tuple[Path, str],
                                                                     state: tuple[int, Path], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    exporters = Exporters(ExportConfig(console=True))
    exporters.start()
    incidents = _incidents(BundleSettings(f"file://{tmp_path}/shipped", termination_log=None), quiet_db[0], state,
                           exporters)
    name, _ = _spooled_by_hand(incidents, tmp_path, age_s=1.0)
    wait_for(lambda: (tmp_path / "shipped" / name).exists(), timeout=10, what="the upload")
    _close(incidents)
    exporters.close()  # the last flush carries the announcement
    assert f"file://{tmp_path}/shipped/{name}" in capsys.readouterr().out


def test_the_shippers_options_are_passed_on(quiet_db: tuple[Path, str], state: tuple[int, Path],
                                            tmp_path: Path) -> None:
    # A first back-off of 50 ms: three tries within a second (the default, 1 s then 2 s, takes 3 s).
    shipping = Shipping(_blocked(tmp_path), state[0], state[1], None, None, first_backoff=0.05, max_backoff=0.1)
    try:
        make_bundle(tmp_path / "built")
        spool.enqueue(next((tmp_path / "built").iterdir()))
        wait_for(lambda: shipping.shipper.failures >= 3, timeout=1.5, what="three tries")
    finally:
        shipping.close(0.5)


def test_bundles_left_from_before_are_counted_before_the_first_pass_and_the_caps_are_the_settings(
        state: tuple[int, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Two bundles an earlier sidecar spooled and never shipped; the destination refuses every upload, so both
    # stay. They are counted before the shipper's first pass could ship or drop any of them.
    caplog.set_level(logging.INFO, "memwatch.serve")
    left = spool.Spool(state[0], state[1])
    for run in ("run1", "run2"):
        left.enqueue(make_bundle(tmp_path / "built", run=run))
    names = left.pending()
    left.close()
    dest = _blocked(tmp_path)
    shipping = Shipping(dest, state[0], state[1], None, None, rescan=60.0, spool_count=3, spool_bytes=1 << 20)
    try:
        assert f"shipping incident bundles to {dest} (spool {state[1]}/bundles, 2 waiting from before)" \
            in caplog.messages
        assert (shipping.spool.cap_count, shipping.spool.cap_bytes) == (3, 1 << 20)
        assert shipping.spool.pending() == names
    finally:
        shipping.close(1.0)


LONG_AGO_NS = 10**9
"""1970-01-01T00:00:01Z: a wait of some 1.8e9 s, so a bound off by one part in a billion is off by seconds."""


def _owed_under_a_taken_name(db_path: Path, run_id: str, build_dir: Path, decided_ns: int) -> None:
    """A bundle owed since ``decided_ns`` whose name a folder takes in ``build_dir``: every build of it fails."""
    name = "memwatch-incident-19700101T000001Z-pod-x-taken.tar.gz"
    (build_dir / name).mkdir(parents=True, mode=0o700)
    os.chmod(build_dir, 0o700)
    _sql(db_path, "INSERT INTO incidents (run_id, trigger, decided_ns, state, bundle) VALUES (?, 'oom', ?, "
         "'building', ?)", (run_id, decided_ns, name))


def test_a_bundle_owed_is_overdue_by_the_nanosecond_once_the_builder_has_stopped(
        quiet_db: tuple[Path, str], state: tuple[int, Path], tmp_path: Path) -> None:
    # The shutdown's round, its deadline passed, stops the builder, builds nothing and records when the oldest bundle
    # still owed was decided: nothing changes that answer while it is read. A bound 0.4 s short of the wait is
    # overdue, one 5 s beyond it is not.
    db_path, run_id = quiet_db
    _owed_under_a_taken_name(db_path, run_id, tmp_path / "built", LONG_AGO_NS)
    incidents = _incidents(BundleSettings(build_dir=tmp_path / "built", termination_log=None), db_path, state)
    triggers = incidents.triggers
    assert triggers is not None
    assert triggers.shutdown((), deadline=0.0) == []
    assert triggers.oldest_owed == LONG_AGO_NS
    waited_s = (time.time_ns() - LONG_AGO_NS) / 1e9
    _overdue_says(incidents, waited_s - 0.4, LONG_AGO_NS, "an incident bundle has waited {} s to be built")
    assert incidents.overdue(waited_s + 5.0) is None
    _close(incidents)


def test_the_counts_add_failed_builds_to_failed_uploads_and_a_spooled_bundle_is_overdue_by_the_nanosecond(
        quiet_db: tuple[Path, str], state: tuple[int, Path], tmp_path: Path) -> None:
    # A build that fails (its name taken) and an upload that fails (the store is below a regular file), both
    # stopped before the counts are read: "failed" is the sum of the two. The spooled bundle is dated 1970 (the one
    # owed was decided just now): it is the one overdue, to the nanosecond as above.
    db_path, run_id = quiet_db
    _owed_under_a_taken_name(db_path, run_id, tmp_path / "built", time.time_ns())
    incidents = _incidents(BundleSettings(_blocked(tmp_path), tmp_path / "built", termination_log=None), db_path,
                           state)
    triggers, shipping = incidents.triggers, incidents.shipping
    assert triggers is not None and shipping is not None
    name, size = _spooled_by_hand(incidents, tmp_path, age_s=1.0)
    wait_for(lambda: triggers.counts["failed"] >= 1 and shipping.shipper.failures >= 1, timeout=10,
             what="a failed build and a failed upload")
    triggers.shutdown((), deadline=0.0)
    shipping.shipper.close(5.0)  # the last pass tries once more; the spool stays open
    built_failed, uploads_failed = triggers.counts["failed"], shipping.shipper.failures
    assert incidents.counts() == {"built": 0, "shipped": 0, "failed": built_failed + uploads_failed, "dropped": 0,
                                  "spool_bytes": size, "spool_bundles": 1}
    os.utime(name, ns=(LONG_AGO_NS, LONG_AGO_NS), dir_fd=shipping.spool.fd)
    waited_s = (time.time_ns() - LONG_AGO_NS) / 1e9
    _overdue_says(incidents, waited_s - 0.4, LONG_AGO_NS, f"bundle {name} has waited {{}} s to be shipped")
    assert incidents.overdue(waited_s + 5.0) is None
    _close(incidents)


def test_a_sidecar_out_of_descriptors_counts_the_spool_it_cannot_list_as_empty_and_not_overdue(
        quiet_db: tuple[Path, str], state: tuple[int, Path], tmp_path: Path) -> None:
    # /readyz and the metrics list the spool through a descriptor of their own; at the process's descriptor limit
    # that open fails, and the answer is "nothing spooled", never an error.
    incidents = _incidents(BundleSettings(_blocked(tmp_path), termination_log=None), quiet_db[0], state)
    shipping = incidents.shipping
    assert shipping is not None
    _, size = _spooled_by_hand(incidents, tmp_path, age_s=1000.0)
    wait_for(lambda: shipping.shipper.failures >= 1, timeout=10, what="a failed upload")
    shipping.shipper.close(5.0)
    assert incidents.counts()["spool_bytes"] == size and incidents.overdue(600.0) is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))
    try:
        counts, overdue = incidents.counts(), incidents.overdue(600.0)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert counts == {"built": 0, "shipped": 0, "failed": shipping.shipper.failures, "dropped": 0, "spool_bytes": 0,
                      "spool_bundles": 0}
    assert overdue is None
    _close(incidents)


def test_a_build_folder_or_spool_held_on_descriptor_0_is_looked_after(quiet_db: tuple[Path, str],
                                                                       state: tuple[int, Path],
                                                                       tmp_path: Path) -> None:
    # Started with descriptor 0 free, the bundles' folders may get it, a descriptor like any other: the build
    # folder's is closed at the stop, and the spool's bundle waiting 1000 s is overdue. (Once SQLite has opened a
    # file it fills a free 0, 1 or 2 with /dev/null, so nothing opens SQLite while 0 is free here.)
    incidents = _incidents(BundleSettings(termination_log=None), quiet_db[0], state)  # the spool's is below
    saved = os.dup(0)
    os.close(0)
    try:
        built = Incidents(BundleSettings(build_dir=tmp_path / "built", termination_log=None), db_path=quiet_db[0],
                          writer=None, detector_config=None, state_fd=state[0], state_dir=state[1],  # type: ignore[arg-type]
                          exporters=None)
        assert built.build_fd == 0
        built.close_triggers(set())
        assert built.build_fd == -1
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(0)
        incidents.shipping = Shipping(_blocked(tmp_path), state[0], state[1], None, None, rescan=60.0)
        assert incidents.shipping.spool.fd == 0
        name, _ = _spooled_by_hand(incidents, tmp_path, age_s=1000.0)
        written = os.stat(name, dir_fd=0).st_mtime_ns
        _overdue_says(incidents, 600.0, written, f"bundle {name} has waited {{}} s to be shipped")
        incidents.close_shipping()
    finally:
        os.dup2(saved, 0)
        os.close(saved)


def test_a_critical_flag_is_passed_to_the_builder_and_without_one_goes_nowhere(quiet_db: tuple[Path, str],
                                                                            state: tuple[int, Path],
                                                                            tmp_path: Path) -> None:
    db_path, run_id = quiet_db
    flag = Flag(run_id, 0, 7, time.time_ns(), "oom_risk", CRITICAL, "near the limit", {})
    without = _incidents(BundleSettings(termination_log=None), db_path, state)
    without.on_flag(flag)
    _close(without)
    incidents = _incidents(BundleSettings(build_dir=tmp_path / "built", termination_log=None), db_path, state)
    incidents.on_flag(flag)  # the builder reads the flag's severity: a critical one wakes it
    _close(incidents)


@pytest.mark.parametrize("cap", ["count", "bytes"])
def test_the_spool_caps_are_the_settings_and_a_bundle_dropped_is_counted(quiet_db: tuple[Path, str],
                                                                         state: tuple[int, Path], tmp_path: Path,
                                                                         cap: str) -> None:
    # Two bundles of about 2.2 KB spooled where the store takes none, under a cap of one bundle or of one and a half
    # bundles' bytes: the second drops the first, and the drop reaches the counts.
    first = make_bundle(tmp_path / "sized").stat().st_size
    limits = {"spool_count": 1} if cap == "count" else {"spool_bytes": first * 3 // 2}
    incidents = _incidents(BundleSettings(_blocked(tmp_path), termination_log=None, **limits), quiet_db[0], state)
    assert incidents.shipping is not None
    _spooled_by_hand(incidents, tmp_path, age_s=2.0, run="run1")
    name, size = _spooled_by_hand(incidents, tmp_path, age_s=1.0, run="run2")
    counts = incidents.counts()
    del counts["failed"]  # the shipper's tries so far
    assert counts == {"built": 0, "shipped": 0, "dropped": 1, "spool_bytes": size, "spool_bundles": 1}
    assert incidents.shipping.spool.pending() == [name]
    _close(incidents)


def test_the_leftovers_of_builds_cut_short_are_removed_at_start(quiet_db: tuple[Path, str], state: tuple[int, Path],
                                                                tmp_path: Path) -> None:
    built = tmp_path / "built"
    (built / ".work-4242-0123456789abcdef").mkdir(parents=True)
    (built / ".work-4242-0123456789abcdef" / "run.db").write_bytes(b"half")
    (built / ".building-x.tar.gz.part").write_bytes(b"half")
    (built / "kept.txt").write_bytes(b"not a build's")
    os.chmod(built, 0o700)
    incidents = _incidents(BundleSettings(build_dir=built, termination_log=None), quiet_db[0], state)
    assert os.listdir(built) == ["kept.txt"]
    held = [fd for fd in _fds(tmp_path) if fd.endswith(f" {built}")]
    assert held == [f"{incidents.build_fd} {built}"]  # one descriptor, the one judged at start, builds there too
    _close(incidents)


def test_a_bundle_owed_that_waits_in_the_spool_already_is_not_built_again(quiet_db: tuple[Path, str],
                                                                          state: tuple[int, Path],
                                                                          tmp_path: Path) -> None:
    # A sidecar stopped after handing the bundle to the spool and before recording it built: the next one finds
    # it there, records it built, and builds nothing.
    db_path, run_id = quiet_db
    left = spool.Spool(state[0], state[1])
    waiting = make_bundle(tmp_path / "before")
    left.enqueue(waiting)
    left.close()
    _sql(db_path, "INSERT INTO incidents (run_id, trigger, decided_ns, state, bundle) VALUES (?, 'oom', ?, "
         "'building', ?)", (run_id, time.time_ns(), waiting.name))
    incidents = _incidents(BundleSettings(_blocked(tmp_path), termination_log=None), db_path, state)
    assert incidents.triggers is not None and incidents.shipping is not None
    wait_for(lambda: _sql(db_path, "SELECT state FROM incidents") == [("built",)], timeout=10,
             what="the bundle recorded built")
    assert incidents.triggers.counts["built"] == 0
    assert incidents.shipping.spool.pending() == [waiting.name]
    assert os.listdir(state[1] / "incidents") == []
    _close(incidents)


def test_the_bundles_an_hour_are_the_settings(quiet_db: tuple[Path, str], state: tuple[int, Path],
                                              tmp_path: Path) -> None:
    # Two bundles owed for one run whose engine uid this sidecar never saw (its ring was read before a restart), at
    # most one an hour: the older is built, the other dropped for the uid "unknown".
    db_path, run_id = quiet_db
    now = time.time_ns()
    for trigger, decided in (("oom", now - 2 * 10**9), ("shutdown", now - 10**9)):
        _sql(db_path, "INSERT INTO incidents (run_id, trigger, decided_ns) VALUES (?, ?, ?)",
             (run_id, trigger, decided))
    settings = BundleSettings(build_dir=tmp_path / "built", termination_log=None, per_hour=1)
    # oom_risk says 73.4 MiB would be left after the next forward, under the default 256 MiB margin; at 1 byte, no risk
    incidents = _incidents(settings, db_path, state, detector_config=DetectorConfig(oom_margin_min_bytes=1))
    assert incidents.triggers is not None

    def settled() -> list[tuple[object, ...]] | None:
        rows = _sql(db_path, "SELECT trigger, state, note FROM incidents ORDER BY decided_ns")
        return rows if all(row[1] not in {"owed", "building"} for row in rows) else None

    done = wait_for(settled, timeout=60, what="both bundles settled")
    assert done == [("oom", "built", None),
                    ("shutdown", "dropped", "over the limit of 1 bundles an hour for uid unknown")]
    assert incidents.counts() == {"built": 1, "shipped": 0, "failed": 0, "dropped": 1, "spool_bytes": 0,
                                  "spool_bundles": 0}
    [built] = (tmp_path / "built").iterdir()
    _, members = load(built.read_bytes())
    assert sorted(json.loads(members[m.EXPLAIN])["flag_kinds"]) == ["activation_over_reserve", "alloc_retries", "oom"]
    _close(incidents)
