"""The sidecar's bundle counts in process: what /metrics and /readyz are told of bundles built, shipped, failed,
dropped and overdue (to the nanosecond), the spool's caps and rate as set, and what an earlier sidecar left.

Real folders, a real copy of a stored run's database, real threads; the stores are local folders, one a regular
file stands in the way of (every upload fails).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from pathlib import Path

import pytest
from sidecar_bundles import blocked_store, close_all, incidents_for, open_below, overdue_says, spooled_by_hand
from test_incident_ship import make_bundle
from test_incident_trigger_rules import _sql

from memwatch.detectors import DetectorConfig
from memwatch.flags import CRITICAL, Flag
from memwatch.incident import manifest as m
from memwatch.incident import spool
from memwatch.incident.open import load
from memwatch.sidecar.shipping import BundleSettings, Incidents, Shipping

from processes import wait_for


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
    dest = blocked_store(tmp_path)
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
    incidents = incidents_for(BundleSettings(build_dir=tmp_path / "built", termination_log=None), db_path, state)
    triggers = incidents.triggers
    assert triggers is not None
    assert triggers.shutdown((), deadline=0.0) == []
    assert triggers.oldest_owed == LONG_AGO_NS
    waited_s = (time.time_ns() - LONG_AGO_NS) / 1e9
    overdue_says(incidents, waited_s - 0.4, LONG_AGO_NS, "an incident bundle has waited {} s to be built")
    assert incidents.overdue(waited_s + 5.0) is None
    close_all(incidents)


def test_the_counts_add_failed_builds_to_failed_uploads_and_a_spooled_bundle_is_overdue_by_the_nanosecond(
        quiet_db: tuple[Path, str], state: tuple[int, Path], tmp_path: Path) -> None:
    # A build that fails (its name taken) and an upload that fails (the store is below a regular file), both
    # stopped before the counts are read: "failed" is the sum of the two. The spooled bundle is dated 1970 (the one
    # owed was decided just now): it is the one overdue, to the nanosecond as above.
    db_path, run_id = quiet_db
    _owed_under_a_taken_name(db_path, run_id, tmp_path / "built", time.time_ns())
    settings = BundleSettings(blocked_store(tmp_path), tmp_path / "built", termination_log=None)
    incidents = incidents_for(settings, db_path, state)
    triggers, shipping = incidents.triggers, incidents.shipping
    assert triggers is not None and shipping is not None
    name, size = spooled_by_hand(incidents, tmp_path, age_s=1.0)
    wait_for(lambda: triggers.counts["failed"] >= 1 and shipping.shipper.failures >= 1, timeout=10,
             what="a failed build and a failed upload")
    triggers.shutdown((), deadline=0.0)
    shipping.shipper.close(5.0)  # the last pass tries once more; the spool stays open
    built_failed, uploads_failed = triggers.counts["failed"], shipping.shipper.failures
    assert incidents.counts() == {"built": 0, "shipped": 0, "failed": built_failed + uploads_failed, "dropped": 0,
                                  "spool_bytes": size, "spool_bundles": 1}
    os.utime(name, ns=(LONG_AGO_NS, LONG_AGO_NS), dir_fd=shipping.spool.fd)
    waited_s = (time.time_ns() - LONG_AGO_NS) / 1e9
    overdue_says(incidents, waited_s - 0.4, LONG_AGO_NS, f"bundle {name} has waited {{}} s to be shipped")
    assert incidents.overdue(waited_s + 5.0) is None
    close_all(incidents)


def test_a_sidecar_out_of_descriptors_counts_the_spool_it_cannot_list_as_empty_and_not_overdue(
        quiet_db: tuple[Path, str], state: tuple[int, Path], tmp_path: Path) -> None:
    # /readyz and the metrics list the spool through a descriptor of their own; at the process's descriptor limit
    # that open fails, and the answer is "nothing spooled", never an error.
    incidents = incidents_for(BundleSettings(blocked_store(tmp_path), termination_log=None), quiet_db[0], state)
    shipping = incidents.shipping
    assert shipping is not None
    _, size = spooled_by_hand(incidents, tmp_path, age_s=1000.0)
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
    close_all(incidents)


def test_a_build_folder_or_spool_held_on_descriptor_0_is_looked_after(quiet_db: tuple[Path, str],
                                                                       state: tuple[int, Path],
                                                                       tmp_path: Path) -> None:
    # Started with descriptor 0 free, the bundles' folders may get it, a descriptor like any other: the build
    # folder's is closed at the stop, and the spool's bundle waiting 1000 s is overdue. (Once SQLite has opened a
    # file it fills a free 0, 1 or 2 with /dev/null, so nothing opens SQLite while 0 is free here.)
    incidents = incidents_for(BundleSettings(termination_log=None), quiet_db[0], state)  # the spool's is below
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
        incidents.shipping = Shipping(blocked_store(tmp_path), state[0], state[1], None, None, rescan=60.0)
        assert incidents.shipping.spool.fd == 0
        name, _ = spooled_by_hand(incidents, tmp_path, age_s=1000.0)
        written = os.stat(name, dir_fd=0).st_mtime_ns
        overdue_says(incidents, 600.0, written, f"bundle {name} has waited {{}} s to be shipped")
        incidents.close_shipping()
    finally:
        os.dup2(saved, 0)
        os.close(saved)


def test_a_critical_flag_is_passed_to_the_builder_and_without_one_goes_nowhere(quiet_db: tuple[Path, str],
                                                                            state: tuple[int, Path],
                                                                            tmp_path: Path) -> None:
    db_path, run_id = quiet_db
    flag = Flag(run_id, 0, 7, time.time_ns(), "oom_risk", CRITICAL, "near the limit", {})
    without = incidents_for(BundleSettings(termination_log=None), db_path, state)
    without.on_flag(flag)
    close_all(without)
    incidents = incidents_for(BundleSettings(build_dir=tmp_path / "built", termination_log=None), db_path, state)
    incidents.on_flag(flag)  # the builder reads the flag's severity: a critical one wakes it
    close_all(incidents)


@pytest.mark.parametrize("cap", ["count", "bytes"])
def test_the_spool_caps_are_the_settings_and_a_bundle_dropped_is_counted(quiet_db: tuple[Path, str],
                                                                         state: tuple[int, Path], tmp_path: Path,
                                                                         cap: str) -> None:
    # Two bundles of about 2.2 KB spooled where the store takes none, under a cap of one bundle or of one and a half
    # bundles' bytes: the second drops the first, and the drop reaches the counts.
    first = make_bundle(tmp_path / "sized").stat().st_size
    limits = {"spool_count": 1} if cap == "count" else {"spool_bytes": first * 3 // 2}
    settings = BundleSettings(blocked_store(tmp_path), termination_log=None, **limits)
    incidents = incidents_for(settings, quiet_db[0], state)
    assert incidents.shipping is not None
    spooled_by_hand(incidents, tmp_path, age_s=2.0, run="run1")
    name, size = spooled_by_hand(incidents, tmp_path, age_s=1.0, run="run2")
    counts = incidents.counts()
    del counts["failed"]  # the shipper's tries so far
    assert counts == {"built": 0, "shipped": 0, "dropped": 1, "spool_bytes": size, "spool_bundles": 1}
    assert incidents.shipping.spool.pending() == [name]
    close_all(incidents)


def test_the_leftovers_of_builds_cut_short_are_removed_at_start(quiet_db: tuple[Path, str], state: tuple[int, Path],
                                                                tmp_path: Path) -> None:
    built = tmp_path / "built"
    (built / ".work-4242-0123456789abcdef").mkdir(parents=True)
    (built / ".work-4242-0123456789abcdef" / "run.db").write_bytes(b"half")
    (built / ".building-x.tar.gz.part").write_bytes(b"half")
    (built / "kept.txt").write_bytes(b"not a build's")
    os.chmod(built, 0o700)
    incidents = incidents_for(BundleSettings(build_dir=built, termination_log=None), quiet_db[0], state)
    assert os.listdir(built) == ["kept.txt"]
    held = [fd for fd in open_below(tmp_path) if fd.endswith(f" {built}")]
    assert held == [f"{incidents.build_fd} {built}"]  # one descriptor, the one judged at start, builds there too
    close_all(incidents)


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
    incidents = incidents_for(BundleSettings(blocked_store(tmp_path), termination_log=None), db_path, state)
    assert incidents.triggers is not None and incidents.shipping is not None
    wait_for(lambda: _sql(db_path, "SELECT state FROM incidents") == [("built",)], timeout=10,
             what="the bundle recorded built")
    assert incidents.triggers.counts["built"] == 0
    assert incidents.shipping.spool.pending() == [waiting.name]
    assert os.listdir(state[1] / "incidents") == []
    close_all(incidents)


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
    incidents = incidents_for(settings, db_path, state, detector_config=DetectorConfig(oom_margin_min_bytes=1))
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
    close_all(incidents)
