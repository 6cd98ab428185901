"""The sidecar's bundles in process: the build folder it may use, the spool and shipper started and stopped, the
counts and the "overdue" answer /readyz gives, and the grace period shared by the last builds and uploads.

Real folders, a real copy of a stored run's database (the simulator's ``long_prefill``, ended ``oom``), real
threads; the stores are a local folder, one a regular file stands in the way of (every upload fails), and a socket
that accepts and never answers (every upload hangs).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from sidecar_bundles import blocked_store, close_all, incidents_for, open_below, overdue_says, spooled_by_hand
from test_incident_ship import make_bundle
from test_incident_trigger_rules import _sql, copy_of

from memwatch.errors import PermissionDeniedError
from memwatch.export.config import ExportConfig
from memwatch.export.pipeline import Exporters
from memwatch.incident import spool
from memwatch.sidecar.shipping import BundleSettings, Shipping, open_build_dir

from processes import wait_for
from ship_s3 import CREDENTIALS


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
    before = open_below(tmp_path)
    with pytest.raises(PermissionDeniedError) as refused:
        open_build_dir(shared)
    assert str(refused.value) == (f"MEMWATCH_BUNDLE_DIR {shared} can be written by other users (mode 775); bundles "
                                  "are built only in a folder of the sidecar's user that no other user can write "
                                  "(chown it, chmod 700)")
    assert open_below(tmp_path) == before
    if os.geteuid() == 0:
        os.chmod(shared, 0o700)
        os.chown(shared, 4242, 4242)
        with pytest.raises(PermissionDeniedError, match=rf"{shared} belongs to uid 4242, not 0; bundles are built"):
            open_build_dir(shared)
        assert open_below(tmp_path) == before
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
    before = open_below(state[1].parent)
    incidents = incidents_for(BundleSettings(termination_log=None, grace_s=30.0), quiet_db[0], state)
    assert (incidents.shipping, incidents.triggers, incidents.build_fd) == (None, None, -1)
    assert incidents.counts() == {"built": 0, "shipped": 0, "failed": 0, "dropped": 0, "spool_bytes": 0,
                                  "spool_bundles": 0}
    assert incidents.overdue(0.0) is None
    assert incidents.exit_margin_s == 6.0  # 5 s spare and 1 s to exit; no exporters to flush
    assert 23.9 < incidents.grace_left() <= 24.0  # before the loop's first round: from now
    incidents.tick()
    time.sleep(0.3)
    assert 22.0 < incidents.grace_left() <= 23.7  # from the round, however long ago
    close_all(incidents)
    assert open_below(state[1].parent) == before
    with_exporters = incidents_for(BundleSettings(termination_log=None), quiet_db[0], state, Exporters(ExportConfig()))
    assert with_exporters.exit_margin_s == 11.0  # and 5 s for the exporters' last flush
    close_all(with_exporters)


def test_a_bundle_owed_is_built_beside_the_spool_shipped_and_counted(long_prefill_stored: tuple[Path, str],
                                                                     state: tuple[int, Path], tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    db_path = copy_of(long_prefill_stored[0], tmp_path / "memwatch.db")  # its oom bundle is owed
    dest = f"file://{tmp_path}/shipped"
    exporters = Exporters(ExportConfig())
    before = open_below(tmp_path)
    incidents = incidents_for(BundleSettings(dest, termination_log=None), db_path, state, exporters)
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
    assert open_below(tmp_path) == before


def test_a_bundle_the_store_cannot_take_waits_counted_and_is_overdue(quiet_db: tuple[Path, str],
                                                                    state: tuple[int, Path], tmp_path: Path) -> None:
    incidents = incidents_for(BundleSettings(blocked_store(tmp_path), termination_log=None), quiet_db[0], state)
    assert incidents.shipping is not None
    name, size = spooled_by_hand(incidents, tmp_path, age_s=1000.0)
    counts = wait_for(lambda: (c := incidents.counts())["failed"] and c, timeout=10, what="a failed upload")
    assert counts == {"built": 0, "shipped": 0, "failed": 1, "dropped": 0, "spool_bytes": size, "spool_bundles": 1}
    written = (state[1] / "bundles" / name).stat().st_mtime_ns
    overdue_says(incidents, 600.0, written, f"bundle {name} has waited {{}} s to be shipped")
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
    incidents = incidents_for(BundleSettings(build_dir=tmp_path / "built", termination_log=None), db_path, state)
    assert incidents.triggers is not None
    wait_for(lambda: incidents.triggers.oldest_owed is not None, what="the builder's first round")  # type: ignore[union-attr]
    overdue_says(incidents, 600.0, decided, "an incident bundle has waited {} s to be built")
    assert incidents.overdue(1501.0) is None
    assert incidents.counts()["failed"] >= 1
    close_all(incidents)


@pytest.mark.parametrize(("grace_s", "built"), [(9.0, 0), (60.0, 1)])
def test_the_shutdown_builds_only_within_the_grace_period_less_the_uploads_reserve(
        quiet_db: tuple[Path, str], state: tuple[int, Path], tmp_path: Path, grace_s: float, built: int) -> None:
    # 9 s less the 6 s kept for exiting leaves 3 s, all of it the uploads' reserve: no build begins.
    db_path, run_id = quiet_db
    incidents = incidents_for(BundleSettings(build_dir=tmp_path / "built", termination_log=None, grace_s=grace_s),
                              db_path, state)
    incidents.tick()
    incidents.close_triggers({run_id})
    assert len(os.listdir(tmp_path / "built")) == built
    assert _sql(db_path, "SELECT trigger, state FROM incidents") == [("shutdown", "built" if built else "owed")]
    incidents.close_shipping()


def test_without_a_shutdown_nothing_is_owed_for_the_runs(quiet_db: tuple[Path, str], state: tuple[int, Path],
                                                         tmp_path: Path) -> None:
    incidents = incidents_for(BundleSettings(build_dir=tmp_path / "built", termination_log=None), quiet_db[0], state)
    incidents.close_triggers(set())
    assert os.listdir(tmp_path / "built") == [] and _sql(quiet_db[0], "SELECT * FROM incidents") == []


def test_shipping_starts_at_once_takes_what_a_build_hands_it_and_stops_taking(state: tuple[int, Path],
                                                                              tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "memwatch.serve")
    dest = tmp_path / "shipped"
    log = tmp_path / "term"
    log.write_bytes(b"")
    before = open_below(tmp_path)
    shipping = Shipping(f"file://{dest}", state[0], state[1], None, log, rescan=60.0)  # no rescan in this test
    assert f"shipping incident bundles to file://{dest} (spool {state[1]}/bundles)" in caplog.messages
    first = make_bundle(tmp_path / "built", run="run1")
    spool.enqueue(first)  # what a bundle built anywhere in the process does
    wait_for(lambda: (dest / first.name).exists(), timeout=3, what="the upload, at once")
    assert log.read_text() == f"memwatch incident: oom (oom) file://{dest}/{first.name}\n"
    shipping.close(1.0)
    assert open_below(tmp_path) == before  # the spool, the termination log's folder
    second = make_bundle(tmp_path / "built", run="run2")
    spool.enqueue(second)
    assert second.exists()  # no sidecar shipping any more: it stays where it was built


def test_a_build_folder_others_may_enter_is_refused_and_nothing_is_left_open(quiet_db: tuple[Path, str],
                                                                             state: tuple[int, Path],
                                                                             tmp_path: Path) -> None:
    (state[1] / "incidents").mkdir(mode=0o755)
    os.chmod(state[1] / "incidents", 0o755)
    before = open_below(tmp_path)
    with pytest.raises(PermissionDeniedError) as refused:
        incidents_for(BundleSettings(f"file://{tmp_path}/shipped", termination_log=None), quiet_db[0], state)
    assert str(refused.value) == (f"cannot build bundles in {state[1]}/incidents: mode 755 lets other users in; "
                                  "chmod 700 it; it must be a directory of the sidecar's user, mode 0700")
    assert open_below(tmp_path) == before
    os.chmod(state[1] / "incidents", 0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionDeniedError, match="--termination-log"):  # after the build folder was opened
        incidents_for(BundleSettings(f"file://{tmp_path}/shipped", termination_log=shared / "log"), quiet_db[0], state)
    assert open_below(tmp_path) == before


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
        incidents = incidents_for(BundleSettings(dest, termination_log=None, grace_s=grace_s), quiet_db[0], state)
        shipping = incidents.shipping
        assert shipping is not None
        spooled_by_hand(incidents, tmp_path, age_s=1.0)
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
    incidents = incidents_for(BundleSettings(f"file://{tmp_path}/shipped", termination_log=None), quiet_db[0], state,
                              exporters)
    name, _ = spooled_by_hand(incidents, tmp_path, age_s=1.0)
    wait_for(lambda: (tmp_path / "shipped" / name).exists(), timeout=10, what="the upload")
    close_all(incidents)
    exporters.close()  # the last flush carries the announcement
    assert f"file://{tmp_path}/shipped/{name}" in capsys.readouterr().out


def test_the_shippers_options_are_passed_on(quiet_db: tuple[Path, str], state: tuple[int, Path],
                                            tmp_path: Path) -> None:
    # A first back-off of 50 ms: three tries within a second (the default, 1 s then 2 s, takes 3 s).
    shipping = Shipping(blocked_store(tmp_path), state[0], state[1], None, None, first_backoff=0.05, max_backoff=0.1)
    try:
        make_bundle(tmp_path / "built")
        spool.enqueue(next((tmp_path / "built").iterdir()))
        wait_for(lambda: shipping.shipper.failures >= 3, timeout=1.5, what="three tries")
    finally:
        shipping.close(0.5)
