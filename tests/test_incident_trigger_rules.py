"""The trigger rules on a stored run, in process with a hand-set clock: which flags, endings and shutdowns bundle.

The run is the simulator's ``long_prefill`` stored by the real collector (status ``oom``, critical flags
``oom_risk`` and ``oom``); the decisions are the database's own (its ``incidents`` rows, written by SQLite in the
transaction that stores the cause) and the triggers build real bundles from them. The sidecar processes that drive
these same rules are in test_incident_triggers.py and test_incident_write_ahead.py.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import time
from pathlib import Path

import pytest

from memwatch.incident.open import load
from memwatch.incident.ratelimit import PerUid
from memwatch.incident.triggers import IncidentTriggers
from memwatch_engine.ring_reader import RingHeader


def copy_of(stored: Path, path: Path) -> Path:
    """A copy of the stored database at ``path`` (with what its WAL holds), for one test to change."""
    source, target = sqlite3.connect(stored), sqlite3.connect(path)
    source.backup(target)
    source.close()
    target.close()
    return path


@pytest.fixture
def db(long_prefill_stored: tuple[Path, str], tmp_path: Path) -> tuple[Path, str]:
    """A copy of the stored run, its bundles still owed, for one test to build from and change."""
    return copy_of(long_prefill_stored[0], tmp_path / "memwatch.db"), long_prefill_stored[1]


class Clock:
    """Wall-clock nanoseconds, moved forward by hand."""

    def __init__(self) -> None:
        self.ahead = 0

    def __call__(self) -> int:
        return time.time_ns() + self.ahead


def _sql(db_path: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(db_path)
    try:
        with conn:
            return list(conn.execute(sql, params))
    finally:
        conn.close()


def _header(run_id: str, uid: int | None = 1000) -> RingHeader:
    return RingHeader(run_id, 0, 1, 1, 1, 1, 1, {"gpu_uuid": "GPU-1234", "engine_version": "0.34.0"},
                      owner_uid=uid)


def _running_with_flags(db_path: Path, run_id: str, *kinds: str) -> None:
    """The run as if still serving: no bundle decided yet, then ``kinds`` flagged critical now."""
    _sql(db_path, "DELETE FROM incidents")
    _sql(db_path, "UPDATE runs SET status = 'running'")
    for kind in kinds:
        _sql(db_path, "INSERT INTO flags (run_id, rank, step, ts_ns, kind, severity, message, data) VALUES"
                      " (?, 0, 1, 1, ?, 'critical', 'words', '{}')", (run_id, kind))


def _made(triggers: IncidentTriggers) -> list[tuple[str, str]]:
    triggers.close()
    return sorted((made.trigger, made.run_id) for made in (load(p.read_bytes())[0] for p in triggers.built))


def _states(db_path: Path) -> dict[str, str]:
    return dict(_sql(db_path, "SELECT trigger, state FROM incidents"))  # type: ignore[arg-type]


def test_the_decision_is_committed_with_its_cause_or_not_at_all(db: tuple[Path, str]) -> None:
    db_path, run_id = db
    _sql(db_path, "DELETE FROM incidents")
    _sql(db_path, "UPDATE runs SET status = 'running'")
    conn = sqlite3.connect(db_path)
    conn.execute("BEGIN")
    conn.execute("UPDATE runs SET status = 'crashed' WHERE run_id = ?", (run_id,))
    conn.rollback()  # the ending never happened: nothing is owed
    assert _states(db_path) == {}
    with conn:
        conn.execute("UPDATE runs SET status = 'crashed' WHERE run_id = ?", (run_id,))
    with conn:  # a flag that is not critical owes nothing; a critical one, once per kind
        for kind, severity in (("fragmentation", "warning"), ("torch_drift", "critical"), ("torch_drift", "critical")):
            conn.execute("INSERT INTO flags (run_id, rank, ts_ns, kind, severity) VALUES (?, 0, 1, ?, ?)",
                         (run_id, kind, severity))
    conn.close()
    assert _states(db_path) == {"crashed": "owed", "torch_drift": "owed"}
    _sql(db_path, "DELETE FROM runs")  # the evidence gone (retention, the size cap): so is what it owed
    assert _states(db_path) == {}


def test_a_critical_flag_bundles_once_per_kind_after_settling(db: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = db
    _running_with_flags(db_path, run_id, "oom_risk", "torch_drift")
    clock = Clock()
    triggers = IncidentTriggers(db_path, tmp_path / "out", settle_s=5.0, clock=clock, poll_s=0.05)
    triggers(_header(run_id), [])  # a drain of the run: its ring's metadata is remembered
    time.sleep(0.5)
    assert triggers.built == []  # within the 5 s settling time: nothing yet
    clock.ahead = int(5.2e9)
    deadline = time.monotonic() + 60
    while len(triggers.built) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _made(triggers) == [("oom_risk", run_id), ("torch_drift", run_id)]
    assert _states(db_path) == {"oom_risk": "built", "torch_drift": "built"}
    manifest = load(triggers.built[0].read_bytes())[0]
    assert (manifest.identity["gpu_uuid"], manifest.identity["engine_version"]) == ("GPU-1234", "0.34.0")
    [(decided,)] = _sql(db_path, "SELECT decided_ns FROM incidents WHERE trigger = 'oom_risk'")
    assert manifest.created_ns == decided  # named and dated by its decision: the same name after a restart


def test_a_run_ending_badly_folds_its_pending_flags_into_one_bundle(db: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = db
    _running_with_flags(db_path, run_id, "oom_risk", "oom")
    clock = Clock()
    triggers = IncidentTriggers(db_path, tmp_path / "out", settle_s=5.0, clock=clock, poll_s=0.05)
    time.sleep(0.3)
    _sql(db_path, "UPDATE runs SET status = 'oom'")  # the run's end: its own row is the oom flag's, one bundle
    triggers.finished(_header(run_id))
    deadline = time.monotonic() + 60
    while not triggers.built and time.monotonic() < deadline:
        time.sleep(0.05)
    clock.ahead = int(60e9)
    time.sleep(0.3)
    assert _made(triggers) == [("oom", run_id)]
    assert _states(db_path) == {"oom": "built", "oom_risk": "merged"}


def test_shutdown_bundles_each_active_run_once(db: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = db
    _sql(db_path, "DELETE FROM incidents")
    triggers = IncidentTriggers(db_path, tmp_path / "out")
    written = triggers.shutdown([run_id, run_id, "no-such-run"])  # an unknown run is logged, not fatal
    assert [load(path.read_bytes())[0].trigger for path in written] == ["shutdown"]
    assert triggers.shutdown([run_id]) == []
    assert _made(triggers) == [("shutdown", run_id)]
    assert dict(_sql(db_path, "SELECT run_id, state FROM incidents")) == {run_id: "built", "no-such-run": "dropped"}


def test_a_uid_over_its_hourly_bundles_gets_no_more(db: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = db
    _running_with_flags(db_path, run_id)
    for kind in ("a", "b", "c"):  # three bundles owed by one run of uid 1000, settled long ago
        _sql(db_path, "INSERT INTO incidents (run_id, trigger, decided_ns) VALUES (?, ?, 1)", (run_id, kind))
    triggers = IncidentTriggers(db_path, tmp_path / "out", limiter=PerUid(per_hour=2), poll_s=0.05, start=False)
    triggers(_header(run_id, uid=1000), [])
    triggers.shutdown([])
    assert _made(triggers) == [("a", run_id), ("b", run_id)]
    assert _states(db_path) == {"a": "built", "b": "built", "c": "dropped"}
    assert triggers.counts == {"built": 2, "failed": 0, "dropped": 1}


def test_the_token_bucket_refills_one_bundle_per_share_of_the_hour() -> None:
    now = [0.0]
    limit = PerUid(per_hour=4, clock=lambda: now[0])
    assert [limit.allow(7) for _ in range(5)] == [True, True, True, True, False]
    assert limit.allow(8)  # another uid has its own bucket
    now[0] = 899.0  # a token every 3600 / 4 = 900 s
    assert not limit.allow(7)
    now[0] = 900.0
    assert limit.allow(7) and not limit.allow(7)
    assert all(PerUid(per_hour=0).allow(1) for _ in range(100))  # 0: no limit
    now[0] = 900.0 + 10 * 3600  # ten idle hours refill at most a burst of 4, never 40
    assert [limit.allow(7) for _ in range(5)] == [True, True, True, True, False]
    assert limit.allow(None) and limit.allow(None)  # runs of no known uid share one bucket


def test_the_buckets_are_bounded_forgetting_the_fullest() -> None:
    now = [0.0]
    limit = PerUid(per_hour=2, clock=lambda: now[0])
    spent = 100_000  # the highest uid: forgetting by uid rather than by fullness would forget it
    assert limit.allow(spent) and limit.allow(spent) and not limit.allow(spent)
    for uid in range(4096):  # 4,097 buckets in all: one too many, the fullest goes (one of the fresh ones)
        limit.allow(uid)
    assert len(limit._buckets) == 4096
    assert not limit.allow(spent)  # the spent bucket is the one kept
    one = PerUid(per_hour=1, clock=lambda: now[0])
    assert one.allow(5) and not one.allow(5)  # one an hour is a limit too


class Fixed:
    """A clock that moves only by hand (ns)."""

    def __init__(self) -> None:
        self.now = time.time_ns()

    def __call__(self) -> int:
        return self.now


def _one_owed(db_path: Path, run_id: str, trigger: str, state: str = "owed", bundle: str | None = None) -> None:
    _sql(db_path, "DELETE FROM incidents")
    _sql(db_path, "INSERT INTO incidents (run_id, trigger, decided_ns, state, bundle) VALUES (?, ?, 1, ?, ?)",
         (run_id, trigger, state, bundle))


def test_a_build_that_fails_is_tried_again_after_1_2_4_s_up_to_30_s(db: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = db
    name = "memwatch-incident-20261204T000000.000Z-pod-a-resumed.tar.gz"
    _one_owed(db_path, run_id, "oom", state="building", bundle=name)  # named before a restart
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)  # in the way: the bundle cannot be published under its name
    spent = PerUid(per_hour=1)
    assert spent.allow(1000)  # uid 1000 has no bundle left this hour: a build begun before is still finished
    clock = Fixed()
    triggers = IncidentTriggers(db_path, out, limiter=spent, clock=clock, poll_s=100.0, start=False)
    triggers(_header(run_id, uid=1000), [])
    for tries, backoff in enumerate((1, 2, 4, 8, 16, 30, 30), start=1):
        triggers._round()
        assert triggers.counts == {"built": 0, "failed": tries, "dropped": 0}
        clock.now += int((backoff - 0.25) * 1e9)
        assert triggers._round() == pytest.approx(0.25)  # not yet due: not tried
        assert triggers.counts["failed"] == tries
        clock.now += int(0.25e9)
    (out / name).rmdir()
    assert triggers._round() == pytest.approx(100.0)  # built: nothing left to wait for but the next poll
    assert triggers.counts == {"built": 1, "failed": 7, "dropped": 0} and triggers.built == [out / name]
    assert _sql(db_path, "SELECT state, bundle FROM incidents") == [("built", name)]
    assert triggers._round() == pytest.approx(100.0) and triggers.counts["built"] == 1  # once
    triggers.close()


def test_a_run_of_no_known_uid_shares_its_bucket_and_each_refusal_is_its_runs_event(db: tuple[Path, str],
                                                                                     tmp_path: Path) -> None:
    db_path, run_id = db
    _one_owed(db_path, run_id, "oom")
    _sql(db_path, "INSERT INTO incidents (run_id, trigger, decided_ns) VALUES (?, 'torch_drift', 2)", (run_id,))
    _sql(db_path, "UPDATE runs SET status = 'ok'")  # the flag's bundle is its own, not merged into an ending
    clock = Fixed()
    clock.now += int(60e9)
    triggers = IncidentTriggers(db_path, tmp_path / "out", limiter=PerUid(per_hour=1), clock=clock, start=False)
    triggers.shutdown([])  # its ring never seen by this sidecar: uid unknown
    why = "over the limit of 1 bundles an hour for uid unknown"
    assert _sql(db_path, "SELECT trigger, state, note FROM incidents ORDER BY decided_ns") == [
        ("oom", "built", None), ("torch_drift", "dropped", why)]  # the older decision took the one token
    assert _sql(db_path, "SELECT run_id, rank, step, ts_ns, data FROM events WHERE kind = 'bundle_dropped'") == [
        (run_id, None, None, clock.now, f'{{"trigger": "torch_drift", "why": "{why}"}}')]
    assert triggers.counts == {"built": 1, "failed": 0, "dropped": 1}
    triggers.close()


def test_a_bundle_already_spooled_is_not_built_again_and_one_not_handed_on_is_tried_next_round(
        db: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = db
    name = "memwatch-incident-20261204T000000.000Z-pod-a-spooled.tar.gz"
    _one_owed(db_path, run_id, "oom", state="building", bundle=name)
    handed: list[str] = []
    refuse = [True]

    def on_bundle(dir_fd: int, given: str) -> None:
        if refuse[0]:
            raise OSError("the spool is not there yet")
        os.unlink(given, dir_fd=dir_fd)
        handed.append(given)

    spooled = IncidentTriggers(db_path, tmp_path / "a", in_spool=lambda n: n == name, on_bundle=on_bundle,
                               start=False)
    spooled.shutdown([])
    assert spooled.counts["built"] == 0 and spooled.built == [] and _states(db_path) == {"oom": "built"}
    spooled.close()

    _one_owed(db_path, run_id, "oom")
    out = tmp_path / "b"
    triggers = IncidentTriggers(db_path, out, on_bundle=on_bundle, start=False)
    triggers.shutdown([])
    [built] = triggers.built
    assert built.exists() and handed == []  # the hand-on failed: the bundle waits in the build folder
    refuse[0] = False
    triggers.shutdown([])
    assert handed == [built.name] and not built.exists() and triggers.counts["built"] == 1
    triggers.close()


def test_a_shutdown_past_its_deadline_leaves_the_bundles_owed(db: tuple[Path, str], tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    db_path, run_id = db
    _sql(db_path, "DELETE FROM incidents")
    triggers = IncidentTriggers(db_path, tmp_path / "out", start=False)
    assert triggers.shutdown([run_id], deadline=time.monotonic() - 1) == []
    assert _states(db_path) == {"shutdown": "owed"} and triggers.oldest_owed is not None
    assert "the grace period is spent: the incident bundles still owed are built at the next start" in caplog.messages
    assert triggers.shutdown([run_id], deadline=time.monotonic() + 60) != []  # the next start's round
    assert _states(db_path) == {"shutdown": "built"} and triggers.oldest_owed is None
    triggers.close()


def test_the_log_tail_keeps_its_last_lines_each_cut_and_leaves_with_close(db: tuple[Path, str],
                                                                          tmp_path: Path) -> None:
    from memwatch.incident.triggers import LogTail

    tail = LogTail(lines=2)
    logger = logging.getLogger("memwatch-test-tail")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(tail)
    try:
        for text in ("first", "second", "x" * 5000):
            logger.warning(text)
        logger.debug("debug")  # below INFO: not kept
    finally:
        logger.removeHandler(tail)
    lines = tail.tail().decode().splitlines()
    assert len(lines) == 2 and lines[0].endswith("second") and len(lines[1]) == 4096
    triggers = IncidentTriggers(tmp_path / "none.db", tmp_path / "out", start=False)
    assert triggers.log_tail in logging.getLogger("memwatch").handlers
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o700
    for i in range(4100):
        triggers(_header(f"run-{i}"), [])
    assert len(triggers._meta) == 4096  # bounded
    triggers.close()
    assert triggers.log_tail not in logging.getLogger("memwatch").handlers and triggers.dir_fd == -1


def test_a_spool_drop_is_counted_and_recorded_and_a_uid_is_named_from_the_ring(
        db: tuple[Path, str], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db_path, run_id = db
    name = "memwatch-incident-20261204T000000.000Z-pod-a-dropped.tar.gz"
    _one_owed(db_path, run_id, "oom", state="built", bundle=name)
    triggers = IncidentTriggers(db_path, tmp_path / "out", start=False)
    before = time.time_ns()
    triggers.bundle_dropped(name, 1234, "the spool is full")
    assert triggers.counts == {"built": 0, "failed": 0, "dropped": 1}
    assert _sql(db_path, "SELECT state, note FROM incidents") == [("dropped", "the spool is full")]
    [(ts, data)] = _sql(db_path, "SELECT ts_ns, data FROM events WHERE kind = 'bundle_dropped'")
    assert before <= ts <= time.time_ns()
    assert data == f'{{"bundle": "{name}", "bytes": 1234, "why": "the spool is full"}}'
    triggers.close()

    _one_owed(db_path, run_id, "oom")
    _sql(db_path, "INSERT INTO incidents (run_id, trigger, decided_ns) VALUES (?, 'shutdown', 2)", (run_id,))
    limited = IncidentTriggers(db_path, tmp_path / "out2", limiter=PerUid(per_hour=1), start=False)
    limited(_header(run_id, uid=4242), [])
    limited.shutdown([])
    why = "over the limit of 1 bundles an hour for uid 4242"
    assert _sql(db_path, "SELECT trigger, state, note FROM incidents ORDER BY decided_ns") == [
        ("oom", "built", None), ("shutdown", "dropped", why)]
    assert f"run {run_id}: the shutdown incident bundle is dropped: {why}" in caplog.text
    assert limited.counts == {"built": 1, "failed": 0, "dropped": 1}
    limited.close()


def test_only_a_critical_flag_wakes_the_builder(db: tuple[Path, str], tmp_path: Path) -> None:
    from memwatch.flags import Flag

    db_path, run_id = db
    _sql(db_path, "DELETE FROM incidents")
    triggers = IncidentTriggers(db_path, tmp_path / "out", poll_s=60.0)  # its own thread, looking once a minute
    time.sleep(0.5)  # its first round: nothing owed
    _one_owed(db_path, run_id, "oom")  # the run's ending, decided with its commit
    triggers.on_flag(Flag(run_id, 0, 1, 1, "fragmentation", "warning", "words", {}))
    time.sleep(1.0)
    assert triggers.built == []  # a warning wakes nobody
    triggers.on_flag(Flag(run_id, 0, 1, 1, "oom", "critical", "words", {}))
    deadline = time.monotonic() + 30
    while not triggers.built and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(triggers.built) == 1
    triggers.close()
