"""Building the incident bundles owed, in process over a stored run: what each row becomes and why, what is counted
and logged, when a failed build is tried again, and what a bundle carries of the sidecar (its log, the driver).

The run is the simulator's ``long_prefill`` stored by the real collector (status ``oom``); the rows are written into
its real ``incidents`` table, and the failures are real ones: a name taken in the build folder, a bundle over its cap,
and SQLite refusing a statement (a trigger that aborts it, as a full disk would). The clock is set by hand.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path

import pytest
from test_incident_trigger_rules import Fixed, _header, _one_owed, _sql, copy_of

from memwatch.detectors import DetectorConfig
from memwatch.incident import manifest as m
from memwatch.incident.open import load
from memwatch.incident.ratelimit import PerUid
from memwatch.incident.triggers import IncidentTriggers, LogTail
from memwatch_engine.dirfd import open_dir

from fake_nvml import FakeNvmlScript
from stored_runs import START_NS

pytest_plugins = ["fake_nvml"]

FULL = "database or disk is full"
LINE = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} memwatch\.incident WARNING "
"""The start of one of the sidecar's log lines (``memwatch.log_lines.FORMAT``)."""


@pytest.fixture
def db(long_prefill_stored: tuple[Path, str], tmp_path: Path) -> tuple[Path, str]:
    """A copy of the stored run (ended ``oom``) with no bundle owed yet."""
    path = copy_of(long_prefill_stored[0], tmp_path / "memwatch.db")
    _sql(path, "DELETE FROM incidents")
    return path, long_prefill_stored[1]


def _owe(db_path: Path, run_id: str, trigger: str, decided_ns: int, state: str = "owed",
         bundle: str | None = None) -> None:
    _sql(db_path, "INSERT INTO incidents (run_id, trigger, decided_ns, state, bundle) VALUES (?, ?, ?, ?, ?)",
         (run_id, trigger, decided_ns, state, bundle))


def _rows(db_path: Path) -> list[tuple[object, ...]]:
    return _sql(db_path, "SELECT run_id, trigger, state, bundle, note FROM incidents ORDER BY decided_ns")


def _refuse(db_path: Path, name: str, when: str) -> None:
    """SQLite aborts the statement ``when`` describes, with the error a full disk gives."""
    _sql(db_path, f"CREATE TRIGGER {name} {when} BEGIN SELECT RAISE(ABORT, '{FULL}'); END")


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "memwatch.incident"]


def test_each_row_ends_built_merged_or_dropped_and_says_why(db: tuple[Path, str], tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    db_path, run_id = db
    for decided, (run, trigger) in enumerate((("gone-1", "shutdown"), ("gone-2", "shutdown"), (run_id, "oom_risk"),
                                              (run_id, "oom")), start=1):
        _owe(db_path, run, trigger, decided)
    triggers = IncidentTriggers(db_path, tmp_path / "out", start=False)
    assert triggers.shutdown([]) == triggers.built
    [built] = triggers.built
    gone = "the run is no longer stored"
    assert _rows(db_path) == [("gone-1", "shutdown", "dropped", None, gone),
                              ("gone-2", "shutdown", "dropped", None, gone),
                              (run_id, "oom_risk", "merged", None, "in the run's oom bundle"),
                              (run_id, "oom", "built", built.name, None)]
    assert triggers.counts == {"built": 1, "failed": 0, "dropped": 2}
    dropped = [f"run gone-{n}: the shutdown incident bundle is dropped: {gone}" for n in (1, 2)]
    *said, made = _said(caplog)
    assert said == dropped
    assert re.fullmatch(rf"run {run_id}: incident bundle {re.escape(built.name)} \(oom, \d+\.\d s, "
                        rf"{built.stat().st_size} bytes\)", made)
    manifest, members = load(built.read_bytes())
    assert manifest.trigger == "oom" and manifest.created_ns == 4
    lines = members[m.LOG].decode().splitlines()  # the sidecar's log as it was when the build began
    assert len(lines) == 2
    assert all(re.fullmatch(LINE + re.escape(text), line) for text, line in zip(dropped, lines, strict=True))
    triggers.close()


def test_a_failed_build_waits_its_back_off_while_the_rows_after_it_are_built(db: tuple[Path, str], tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    db_path, run_id = db
    [(host,)] = _sql(db_path, "SELECT hostname FROM runs")
    _owe(db_path, run_id, "oom", START_NS)
    name = f"memwatch-incident-20231114T221320.000Z-{host}-{run_id}.tar.gz"  # START_NS is 1,700,000,000 s
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)  # in the way
    clock = Fixed()
    triggers = IncidentTriggers(db_path, out, clock=clock, poll_s=100.0, start=False)
    assert triggers.shutdown([], deadline=time.monotonic() + 60) == []
    assert _rows(db_path) == [(run_id, "oom", "building", name, None)]  # named before it is built: kept for good
    assert triggers.counts == {"built": 0, "failed": 1, "dropped": 0}
    assert re.fullmatch(rf"run {run_id}: the oom incident bundle could not be built: \[Errno 17\] File exists: "
                        rf"'\.building-[^']+' -> '{re.escape(name)}'; trying again in 1 s", _said(caplog)[-1])
    _owe(db_path, run_id, "shutdown", START_NS + 1)  # decided while the first waits: the same millisecond
    clock.now += int(0.25e9)
    assert triggers._round() == 0.75  # the first still waits its 1 s, to the nanosecond; the second is built
    later = name.replace("T221320.000Z", "T221320.001Z")  # a millisecond later: the first's name is taken
    assert triggers.built == [out / later] and triggers.counts == {"built": 1, "failed": 1, "dropped": 0}
    (out / name).rmdir()
    clock.now += int(0.75e9)
    assert triggers._round() == 100.0
    assert _rows(db_path) == [(run_id, "oom", "built", name, None), (run_id, "shutdown", "built", later, None)]
    assert triggers.built == [out / later, out / name]
    again = "memwatch-incident-20261204T000000.000Z-pod-a-again.tar.gz"  # the same run and trigger owed anew
    _one_owed(db_path, run_id, "oom", state="building", bundle=again)
    (out / again).mkdir()
    triggers._round()
    assert triggers._round() == 1.0  # a built row leaves no back-off behind: 1 s again, not 2
    triggers.close()


def test_a_bundle_over_its_cap_fails_once_and_is_never_tried_again(db: tuple[Path, str], tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    db_path, run_id = db
    _owe(db_path, run_id, "oom", 1)
    _refuse(db_path, "locked", "BEFORE UPDATE ON incidents WHEN NEW.state = 'building'")
    clock = Fixed()
    triggers = IncidentTriggers(db_path, tmp_path / "out", cap_bytes=4096, clock=clock, poll_s=100.0, start=False)
    triggers._round()
    assert triggers._round() == 1.0  # its name could not be recorded: tried again in 1 s
    assert triggers.counts == {"built": 0, "failed": 1, "dropped": 0}
    _sql(db_path, "DROP TRIGGER locked")
    clock.now += int(1e9)
    assert triggers._round() == 100.0
    [(state, note)] = _sql(db_path, "SELECT state, note FROM incidents")
    assert state == "failed" and re.fullmatch(rf"the bundle of run {run_id} is [\d,]+ bytes with only 10 s at full "
                                              r"resolution, over the cap of 4,096 bytes; raise the cap", str(note))
    assert triggers.counts == {"built": 0, "failed": 2, "dropped": 0} and triggers.built == []
    assert _said(caplog)[-1] == f"run {run_id}: the oom incident bundle is failed: {note}"
    clock.now += int(60e9)
    assert triggers._round() == 100.0 and triggers.counts["failed"] == 2  # said once, not tried again
    _one_owed(db_path, run_id, "oom")  # owed anew: a settled row left no back-off behind
    _refuse(db_path, "locked", "BEFORE UPDATE ON incidents WHEN NEW.state = 'building'")
    triggers._round()
    assert triggers._round() == 1.0
    triggers.close()


def test_a_statement_the_database_refuses_is_logged_and_the_other_rows_go_on(db: tuple[Path, str], tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    db_path, run_id = db
    _owe(db_path, run_id, "oom_risk", 1)
    _owe(db_path, run_id, "oom", 2)
    _refuse(db_path, "no_shutdown", "BEFORE INSERT ON incidents WHEN NEW.trigger = 'shutdown'")
    _refuse(db_path, "no_merge", "BEFORE UPDATE ON incidents WHEN NEW.state = 'merged'")
    triggers = IncidentTriggers(db_path, tmp_path / "out", start=False)
    [built] = triggers.shutdown([run_id])
    assert _said(caplog)[:2] == [f"run {run_id}: the shutdown bundle could not be recorded: {FULL}",
                                 f"run {run_id}: the oom_risk bundle owed cannot be judged yet: {FULL}"]
    assert _rows(db_path) == [(run_id, "oom_risk", "owed", None, None), (run_id, "oom", "built", built.name, None)]
    triggers.close()


def test_each_uid_has_its_own_bucket_and_a_refusal_is_settled_even_unrecorded(db: tuple[Path, str], tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    db_path, run_id = db
    _owe(db_path, run_id, "oom", 1)
    _owe(db_path, run_id, "shutdown", 2)
    _refuse(db_path, "no_event", "BEFORE INSERT ON events WHEN NEW.kind = 'bundle_dropped'")
    limiter = PerUid(per_hour=1)
    assert limiter.allow(None)  # runs of no known uid have spent their hour
    triggers = IncidentTriggers(db_path, tmp_path / "out", limiter=limiter, start=False)
    triggers(_header(run_id, uid=4242), [])
    [built] = triggers.shutdown([])
    why = "over the limit of 1 bundles an hour for uid 4242"
    assert _rows(db_path) == [(run_id, "oom", "built", built.name, None), (run_id, "shutdown", "dropped", None, why)]
    assert f"run {run_id}: the refused bundle's event could not be stored: {FULL}" in _said(caplog)
    assert triggers.counts == {"built": 1, "failed": 0, "dropped": 1}
    _sql(db_path, "DROP TRIGGER no_event")
    triggers.bundle_dropped(built.name, 10, "the spool is full")  # twice: each drop is counted
    triggers.bundle_dropped(built.name, 10, "the spool is full")
    assert triggers.counts["dropped"] == 3
    triggers.close()


def test_only_a_whole_file_under_its_name_is_a_bundle_built_already(db: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = db
    whole, link = "memwatch-incident-20261204T000000.000Z-pod-a-whole.tar.gz", "memwatch-incident-x-link.tar.gz"
    _owe(db_path, run_id, "oom", 1, state="building", bundle=whole)
    out = tmp_path / "out"
    out.mkdir()
    (out / whole).write_bytes(b"built before a restart")
    (tmp_path / "elsewhere").write_bytes(b"not a bundle")
    (out / link).symlink_to(tmp_path / "elsewhere")
    _owe(db_path, run_id, "shutdown", 2, state="building", bundle=link)
    triggers = IncidentTriggers(db_path, out, clock=Fixed(), start=False)
    assert triggers.shutdown([]) == []
    assert (out / whole).read_bytes() == b"built before a restart"  # not built again
    assert _rows(db_path) == [(run_id, "oom", "built", whole, None), (run_id, "shutdown", "building", link, None)]
    assert triggers.counts == {"built": 0, "failed": 1, "dropped": 0}  # a link is no bundle, nor replaced by one
    assert (out / link).is_symlink()
    triggers.close()


def test_what_cannot_be_read_listed_or_handed_on_is_logged(db: tuple[Path, str], tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    db_path, run_id = db
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database " * 100)
    unreadable = IncidentTriggers(garbage, tmp_path / "a", start=False)
    assert unreadable._round() == 30.0 and unreadable.oldest_owed is None
    assert _said(caplog)[-1] == (f"cannot read the incident bundles owed ({garbage} is not a usable memwatch database "
                                 "(file is not a database); pass another --db); trying again in 30 s")
    unreadable.close()

    (tmp_path / "file").write_bytes(b"")
    fd = os.open(tmp_path / "file", os.O_RDONLY)
    try:
        listless = IncidentTriggers(db_path, tmp_path / "b", dir_fd=fd, on_bundle=lambda _fd, _name: None, start=False)
        listless._round()
        assert _said(caplog)[-1] == f"cannot list the bundle build folder {tmp_path / 'b'}: Not a directory"
        listless.close()
    finally:
        os.close(fd)

    def full(_fd: int, _name: str) -> None:
        raise OSError(FULL)

    _owe(db_path, run_id, "oom", 1)
    refused = IncidentTriggers(db_path, tmp_path / "c", on_bundle=full, start=False)
    [built] = refused.shutdown([])
    assert _said(caplog)[-1] == f"the bundle {built.name} could not be handed on: {FULL}; tried again later"
    refused.close()


def test_a_flag_waits_its_settling_time_to_the_nanosecond_and_a_clock_at_zero_builds(db: tuple[Path, str],
                                                                                     tmp_path: Path) -> None:
    db_path, run_id = db
    _sql(db_path, "UPDATE runs SET status = 'running'")
    clock = Fixed()
    clock.now = 0  # a shutdown decided at the clock's zero is due at once
    _owe(db_path, run_id, "shutdown", 0)
    triggers = IncidentTriggers(db_path, tmp_path / "out", clock=clock, poll_s=100.0, start=False)
    assert triggers._round() == 100.0 and len(triggers.built) == 1
    _owe(db_path, run_id, "torch_drift", START_NS)
    clock.now = START_NS + int(1.5e9)
    assert triggers._round() == 3.5  # settles 5 s after its decision
    clock.now = START_NS + int(5e9)
    assert triggers._round() == 100.0 and len(triggers.built) == 2
    triggers.close()


def test_the_build_folder_and_its_descriptor_are_kept_as_given(db: tuple[Path, str], tmp_path: Path) -> None:
    db_path, _ = db
    nested = tmp_path / "a" / "b" / "out"
    made = IncidentTriggers(db_path, nested, start=False)  # its parents made too
    assert nested.is_dir() and made.oldest_owed is None  # nothing known before the first round
    made.close()
    given = open_dir(nested)
    try:
        lent = IncidentTriggers(db_path, nested, dir_fd=given, start=False)
        lent.close()
        assert lent.dir_fd == given and os.listdir(given) == []  # the caller's descriptor is the caller's to close
    finally:
        os.close(given)
    stdin = os.dup(0)
    try:
        os.close(0)  # a sidecar started with stdin closed: its folder's descriptor is 0, and still its own
        own = IncidentTriggers(db_path, nested, start=False)
        assert own.dir_fd == 0
        own.close()
        assert own.dir_fd == -1
        with pytest.raises(OSError):
            os.fstat(0)
    finally:
        os.dup2(stdin, 0)
        os.close(stdin)


def test_the_builder_is_a_named_daemon_thread(db: tuple[Path, str], tmp_path: Path) -> None:
    triggers = IncidentTriggers(db[0], tmp_path / "out", poll_s=60.0)
    try:
        [thread] = [t for t in threading.enumerate() if t.name == "memwatch-incidents"]
        assert thread.daemon  # never keeps a sidecar that is exiting alive
    finally:
        triggers.close()
    assert not [t for t in threading.enumerate() if t.name == "memwatch-incidents"]


def test_a_bundle_names_the_driver_the_rings_gpu_and_the_detector_settings(
        db: tuple[Path, str], tmp_path: Path, fake_nvml: FakeNvmlScript) -> None:
    db_path, run_id = db
    _owe(db_path, run_id, "oom", 1)
    # oom_risk says 73.4 MiB would be left after the next forward, under the default 256 MiB margin; at 1 byte, no risk
    triggers = IncidentTriggers(db_path, tmp_path / "out", detector_config=DetectorConfig(oom_margin_min_bytes=1),
                                start=False)
    header = _header(run_id)
    header.meta["engine_version"] = 34  # not a string: not taken (the run's row has none either)
    triggers(header, [])
    [built] = triggers.shutdown([])
    manifest, members = load(built.read_bytes())
    assert {key: manifest.identity[key] for key in ("driver_version", "gpu_uuid", "engine_version")} == {
        "driver_version": "550.54.15", "gpu_uuid": "GPU-1234", "engine_version": None}
    assert sorted(json.loads(members[m.EXPLAIN])["flag_kinds"]) == ["activation_over_reserve", "alloc_retries", "oom"]
    triggers.close()


def test_no_driver_is_a_null_driver_version(db: tuple[Path, str], tmp_path: Path,
                                            fake_nvml: FakeNvmlScript) -> None:
    db_path, run_id = db
    fake_nvml.fail("nvmlInitWithFlags", 9)  # NVML_ERROR_DRIVER_NOT_LOADED
    fake_nvml.write()
    _owe(db_path, run_id, "oom", 1)
    triggers = IncidentTriggers(db_path, tmp_path / "out", start=False)
    [built] = triggers.shutdown([])
    assert load(built.read_bytes())[0].identity["driver_version"] is None
    triggers.close()


def test_the_log_tail_keeps_a_name_that_is_not_utf8_as_escapes() -> None:
    tail = LogTail()
    logger = logging.getLogger("memwatch.incident")
    logger.addHandler(tail)
    try:
        logger.warning("ring %s skipped", os.fsdecode(b"r\xe9.ring"))  # a file name in Latin-1
    finally:
        logger.removeHandler(tail)
    [line] = tail.tail().splitlines()
    assert re.fullmatch(LINE.encode() + rb"ring r\\udce9\.ring skipped", line)


def test_closing_waits_for_a_hung_hand_on_only_so_long(db: tuple[Path, str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from memwatch.incident import triggers as module

    monkeypatch.setattr(module, "WORKER_JOIN_S", 0.5)  # 15 s in the sidecar: this test's wait, shortened
    db_path, run_id = db
    _owe(db_path, run_id, "oom", 1)
    entered, release = threading.Event(), threading.Event()

    def hung(_fd: int, _name: str) -> None:  # a spool on a file system that stopped answering
        entered.set()
        release.wait(30)

    triggers = IncidentTriggers(db_path, tmp_path / "out", on_bundle=hung, poll_s=60.0)
    assert entered.wait(60)
    timer = threading.Timer(5.0, release.set)  # it answers again after 5 s
    timer.start()
    started = time.monotonic()
    triggers.close()
    waited = time.monotonic() - started
    release.set()
    timer.cancel()
    assert 0.5 <= waited < 3.0
    deadline = time.monotonic() + 30
    while [t for t in threading.enumerate() if t.name == "memwatch-incidents"] and time.monotonic() < deadline:
        time.sleep(0.05)
