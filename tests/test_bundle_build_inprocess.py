"""Building a bundle in process from a real stored run: what it holds, how it is named and published, and what
goes when it is over its cap.

The run is the simulator's ``long_prefill`` (an out-of-memory at step 203; 215 samples over 7.5 s, 21 events, 4
flags), stored by the real collector with the live detectors; each test builds from its own copy into a real
folder opened by descriptor, with the bundle's moment set by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_incident_bundle import _long_run
from test_incident_trigger_rules import _sql, copy_of

from memwatch.detectors import DetectorConfig
from memwatch.errors import MemwatchError
from memwatch.incident import manifest as m
from memwatch.incident import pgzip
from memwatch.incident.bundle import (
    COMPRESS_LEVEL,
    LOG_TAIL_BYTES,
    MIN_WINDOW_NS,
    BundleTooLarge,
    _accounts,
    _archive,
    build,
    build_at,
    build_bundle,
)
from memwatch.store import open_store
from memwatch.store.db import Database
from memwatch.store.run_model import load_run
from memwatch_engine.dirfd import open_dir

from stored_runs import START_NS

MOMENT = 1_800_000_000_123_456_789
"""2027-01-15 08:00:00.123456789 UTC."""
EDGE = 1_800_000_000_123_999_999
"""A nanosecond before 08:00:00.124: one millisecond later is .124, whatever is added beyond it is not."""
STAMP = "20270115T080000.123Z"
pytestmark = pytest.mark.timeout(60)
"""Each build here takes seconds: one whose loop over the cap never ended fails, rather than hanging the suite."""
FLAG_KINDS = ["activation_over_reserve", "oom_risk", "alloc_retries", "oom"]
"""The run's flags in time order: the prefill's activation peak and the risk at steps 201 and 203, then the OOM."""


@pytest.fixture
def run(long_prefill_stored: tuple[Path, str], tmp_path: Path) -> tuple[Database, str]:
    """A copy of the stored run, open for reading."""
    db = open_store(copy_of(long_prefill_stored[0], tmp_path / "memwatch.db"), readonly=True)
    yield db, long_prefill_stored[1]
    db.conn.close()


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {info.name: tar.extractfile(info).read() for info in tar}  # type: ignore[union-attr]


def _build_at(db: Database, run_id: str, folder: Path, **options: object):  # type: ignore[no-untyped-def]
    folder.mkdir(mode=0o700, exist_ok=True)
    fd = open_dir(folder)
    try:
        return build_at(db, run_id, "oom", fd, folder, **options)  # type: ignore[arg-type]
    finally:
        os.close(fd)


def test_the_bundle_holds_each_member_its_manifest_declares(run: tuple[Database, str], tmp_path: Path) -> None:
    db, run_id = run
    host = db.execute("SELECT hostname FROM runs").fetchone()[0]
    started = time.monotonic()
    built = _build_at(db, run_id, tmp_path / "out", created_ns=MOMENT)
    took = time.monotonic() - started
    name = f"memwatch-incident-{STAMP}-{host}-{run_id}.tar.gz"
    assert (built.path, built.name) == (tmp_path / "out" / name, name)
    assert 0 < built.seconds <= took
    assert os.listdir(tmp_path / "out") == [name]  # no work folder, no hidden part left
    members = _members(built.path)
    assert list(members) == [m.MANIFEST, m.DATABASE, m.LEDGER, m.FLAGS, m.EXPLAIN, m.EVENTS]
    made = built.manifest
    assert members[m.MANIFEST] == made.encode()
    assert made.files == {name: (hashlib.sha256(data).hexdigest(), len(data)) for name, data in members.items()
                          if name != m.MANIFEST}
    assert (made.run_id, made.created_ns, made.trigger, made.verdict) == (run_id, MOMENT, "oom", "oom")
    assert made.window == {"full_from_ns": START_NS, "full_seconds_dropped": 0}  # the first sample, nothing rolled
    assert made.dropped == ()
    assert made.identity["hostname"] == host and made.identity["model"] == "Qwen3-0.6B"
    with tarfile.open(built.path) as tar:
        assert {info.mtime for info in tar} == {1_800_000_000}
    # Byte for byte the archive of these members with run.db deflated on its own, begun before the manifest was
    # made: the same run built twice is the same file.
    with ThreadPoolExecutor(2) as pool:
        early = pgzip.start(pool, members[m.DATABASE], COMPRESS_LEVEL)
        assert built.path.read_bytes() == _archive(made, members, MOMENT, pool, early)
    # The bundle's run.db is the run: its samples and events, as many as the database holds.
    (tmp_path / "run.db").write_bytes(members[m.DATABASE])
    copy = open_store(tmp_path / "run.db", readonly=True)
    try:
        assert copy.execute("SELECT count(*), min(ts_ns) FROM samples").fetchone() == (215, START_NS)
        assert copy.execute("SELECT count(*) FROM events").fetchone() == (21,)
        assert copy.execute("SELECT run_id FROM runs").fetchall() == [(run_id,)]
    finally:
        copy.conn.close()


def test_the_name_is_the_callers_pod_or_the_one_given_and_is_never_overwritten(run: tuple[Database, str],
                                                                                tmp_path: Path) -> None:
    db, run_id = run
    out = tmp_path / "out"
    first = _build_at(db, run_id, out, created_ns=EDGE, identity={"k8s_pod": "pod-7", "hostname": "node-x"})
    assert first.name == f"memwatch-incident-{STAMP}-pod-7-{run_id}.tar.gz"
    assert first.manifest.identity["k8s_pod"] == "pod-7" and first.manifest.identity["hostname"] == "node-x"
    # The same moment again: the next millisecond.
    again = _build_at(db, run_id, out, created_ns=EDGE, identity={"k8s_pod": "pod-7"})
    assert again.name == first.name.replace(".123Z", ".124Z")
    assert again.manifest.created_ns == EDGE  # dated by its moment, whatever name was free
    decided = _build_at(db, run_id, out, created_ns=MOMENT, name="decided.tar.gz")
    assert decided.path == out / "decided.tar.gz" and _members(decided.path)[m.MANIFEST] == decided.manifest.encode()
    with pytest.raises(FileExistsError):
        _build_at(db, run_id, out, created_ns=MOMENT + 10**9, name="decided.tar.gz")
    assert load_manifest(out / "decided.tar.gz").created_ns == MOMENT  # the first one's, untouched
    assert sorted(os.listdir(out)) == sorted([first.name, again.name, "decided.tar.gz"])


def load_manifest(path: Path) -> m.Manifest:
    return m.parse_manifest(_members(path)[m.MANIFEST])


def test_a_bundle_without_a_moment_is_dated_when_it_is_built(run: tuple[Database, str], tmp_path: Path) -> None:
    db, run_id = run
    before = time.time_ns()
    built = _build_at(db, run_id, tmp_path / "out")
    after = time.time_ns()
    assert before <= built.manifest.created_ns <= after
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(built.manifest.created_ns // 10**9))
    assert built.name.startswith(f"memwatch-incident-{stamp}.{built.manifest.created_ns // 10**6 % 1000:03d}Z-")


def test_build_makes_its_folder_private_and_refuses_one_that_is_a_link(run: tuple[Database, str],
                                                                       tmp_path: Path) -> None:
    db, run_id = run
    out = tmp_path / "a" / "b"
    built = build(db, run_id, "manual", out, clock=lambda: MOMENT)
    assert built.path.parent == out and out.stat().st_mode & 0o777 == 0o700
    assert built.manifest.trigger == "manual" and built.manifest.created_ns == MOMENT
    again = build(db, run_id, "manual", out, clock=lambda: MOMENT)  # an existing folder is used as it is
    assert again.name == built.name.replace(".123Z", ".124Z")
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(OSError):
        build(db, run_id, "manual", tmp_path / "link", clock=lambda: MOMENT + 10**9)
    assert sorted(os.listdir(out)) == sorted([built.name, again.name])
    # A folder others may write (a shared --out): a link planted at the bundle's name is not written through.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's")
    planted = f"memwatch-incident-{STAMP}-pod-s-{run_id}.tar.gz"
    (shared / planted).symlink_to(victim)
    made = build(db, run_id, "manual", shared, identity={"k8s_pod": "pod-s"}, clock=lambda: MOMENT)
    assert made.name == planted.replace(".123Z", ".124Z") and victim.read_bytes() == b"root's"
    assert shared.stat().st_mode & 0o7777 == 0o1777  # an existing folder's mode is not changed


def test_the_log_keeps_its_last_256_kib_and_goes_first_when_the_run_cannot_shrink(run: tuple[Database, str],
                                                                                   tmp_path: Path) -> None:
    db, run_id = run
    log = os.urandom(LOG_TAIL_BYTES + 1000)  # random: gzip cannot shrink it
    kept = _build_at(db, run_id, tmp_path / "kept", created_ns=MOMENT, log_tail=log, name="kept.tar.gz")
    members = _members(kept.path)
    assert members[m.LOG] == log[-LOG_TAIL_BYTES:] and list(members)[-1] == m.LOG
    assert kept.manifest.files[m.LOG][1] == LOG_TAIL_BYTES and kept.manifest.dropped == ()
    bare = _build_at(db, run_id, tmp_path / "bare", created_ns=MOMENT, log_tail=b"", name="bare.tar.gz")
    assert m.LOG not in _members(bare.path) and m.LOG not in bare.manifest.files
    size = bare.path.stat().st_size
    # The run spans 7.5 s, under the 10 s the window is cut to: nothing to roll up, so the log goes.
    low, high = db.execute("SELECT min(ts_ns), max(ts_ns) FROM samples").fetchone()
    assert high - low < MIN_WINDOW_NS
    cut = _build_at(db, run_id, tmp_path / "cut", created_ns=MOMENT, log_tail=log, cap_bytes=size + 1000,
                    name="cut.tar.gz")
    assert cut.manifest.dropped == ("sidecar log tail cut",) and m.LOG not in _members(cut.path)
    assert cut.manifest.window == {"full_from_ns": START_NS, "full_seconds_dropped": 0}
    assert size < cut.path.stat().st_size <= size + 1000  # the manifest says what was dropped: a few bytes more
    # At exactly its size the bundle fits.
    exact = _build_at(db, run_id, tmp_path / "exact", created_ns=MOMENT, cap_bytes=size, name="bare.tar.gz")
    assert exact.manifest.dropped == () and exact.path.read_bytes() == bare.path.read_bytes()


def test_over_the_cap_with_nothing_left_to_drop_the_build_stops_and_leaves_nothing(run: tuple[Database, str],
                                                                                   tmp_path: Path) -> None:
    db, run_id = run
    out = tmp_path / "out"
    bare = _build_at(db, run_id, tmp_path / "bare", created_ns=MOMENT, name="bare.tar.gz")
    size = bare.path.stat().st_size
    with pytest.raises(BundleTooLarge) as raised:
        _build_at(db, run_id, out, created_ns=MOMENT, cap_bytes=size - 1, name="bare.tar.gz")
    assert str(raised.value) == (f"the bundle of run {run_id} is {size:,} bytes with only 10 s at full resolution, "
                                 f"over the cap of {size - 1:,} bytes; raise the cap")
    with pytest.raises(BundleTooLarge, match=re.escape("over the cap of 1,000 bytes; raise the cap")):
        _build_at(db, run_id, out, created_ns=MOMENT, cap_bytes=1000, log_tail=b"a line\n" * 100)
    assert os.listdir(out) == []  # no work folder, no part


def test_the_accounts_are_the_runs_ledger_flags_explanation_and_events(run: tuple[Database, str]) -> None:
    db, run_id = run
    files = _accounts(load_run(db, run_id))
    assert list(files) == [m.LEDGER, m.FLAGS, m.EXPLAIN, m.EVENTS]  # no snapshot was imported
    for name in (m.LEDGER, m.FLAGS, m.EXPLAIN):  # one space a level, keys sorted
        assert files[name] == json.dumps(json.loads(files[name]), indent=1, sort_keys=True).encode()
    ledger = json.loads(files[m.LEDGER])
    assert set(ledger) == {"run", "ranks", "check"}
    assert ledger["run"]["oom_step"] == 203 and [rank["rank"] for rank in ledger["ranks"]] == [0]
    assert ledger["run"]["flag_counts"] == dict.fromkeys(FLAG_KINDS, 1)
    assert ledger["check"]["run_id"] == run_id
    assert json.loads(files[m.EXPLAIN])["outcome"] == "oom"
    flags = json.loads(files[m.FLAGS])
    assert [flag["kind"] for flag in flags] == FLAG_KINDS
    rows = _sql_rows(db, "SELECT rank, step, ts_ns, kind, severity, message, data FROM flags ORDER BY ts_ns, rowid")
    assert flags == [{"rank": r, "step": s, "ts_ns": t, "kind": k, "severity": v, "message": msg, "data": json.loads(d)}
                     for r, s, t, k, v, msg, d in rows]
    assert [flag["step"] for flag in flags] == [201, 203, 203, 203]
    lines = files[m.EVENTS].decode().split("\n")
    assert len(lines) == 21 + 1 and lines[-1] == ""  # a line an event, each ended
    rows = _sql_rows(db, "SELECT rank, step, ts_ns, kind, data FROM events ORDER BY ts_ns, rowid")
    assert lines[:-1] == [json.dumps({"rank": r, "step": s, "ts_ns": t, "kind": k, "data": json.loads(d or "{}")},
                                     sort_keys=True) for r, s, t, k, d in rows]


def _sql_rows(db: Database, sql: str) -> list[tuple[object, ...]]:
    return list(db.execute(sql))


def test_a_snapshots_events_are_its_own_member_and_flag_data_is_read_as_stored(long_prefill_stored: tuple[Path, str],
                                                                               tmp_path: Path) -> None:
    path, run_id = copy_of(long_prefill_stored[0], tmp_path / "memwatch.db"), long_prefill_stored[1]
    snapshot = {"device": 0, "segments": 3}
    _sql(path, "INSERT INTO events VALUES (?, 0, 7, ?, 'snapshot_segments', ?)",
         (run_id, START_NS + 5, json.dumps(snapshot)))
    _sql(path, "INSERT INTO events VALUES (?, 0, 8, ?, 'snapshot_oom', '{}')", (run_id, START_NS + 6))
    _sql(path, """UPDATE flags SET data = '"plain"' WHERE kind = 'oom_risk'""")
    _sql(path, "UPDATE flags SET data = NULL WHERE kind = 'oom'")
    db = open_store(path, readonly=True)
    try:
        files = _accounts(load_run(db, run_id))
    finally:
        db.conn.close()
    assert list(files) == [m.LEDGER, m.FLAGS, m.EXPLAIN, m.EVENTS, m.SNAPSHOT]
    assert json.loads(files[m.SNAPSHOT]) == [
        {"rank": 0, "step": 7, "ts_ns": START_NS + 5, "kind": "snapshot_segments", "data": snapshot},
        {"rank": 0, "step": 8, "ts_ns": START_NS + 6, "kind": "snapshot_oom", "data": {}}]
    assert files[m.SNAPSHOT] == json.dumps(json.loads(files[m.SNAPSHOT]), indent=1, sort_keys=True).encode()
    assert files[m.EVENTS].count(b"\n") == 23
    data = {flag["kind"]: flag["data"] for flag in json.loads(files[m.FLAGS])}
    assert data["oom_risk"] == "plain" and data["oom"] is None and isinstance(data["alloc_retries"], dict)


def test_a_run_without_events_has_an_empty_events_file(long_prefill_stored: tuple[Path, str], tmp_path: Path) -> None:
    path, run_id = copy_of(long_prefill_stored[0], tmp_path / "memwatch.db"), long_prefill_stored[1]
    _sql(path, "DELETE FROM events")
    db = open_store(path, readonly=True)
    try:
        built = _build_at(db, run_id, tmp_path / "out", created_ns=MOMENT)
    finally:
        db.conn.close()
    members = _members(built.path)
    assert members[m.EVENTS] == b"" and built.manifest.files[m.EVENTS] == (hashlib.sha256(b"").hexdigest(), 0)
    assert m.SNAPSHOT not in members


def test_build_bundle_passes_on_every_choice_of_its_caller(run: tuple[Database, str], tmp_path: Path) -> None:
    db, run_id = run
    size = _build_at(db, run_id, tmp_path / "bare", created_ns=MOMENT, identity={"k8s_pod": "pod-9"},
                     name="bare.tar.gz").path.stat().st_size
    # A margin threshold of one byte: the 73.4 MiB left before the OOM is no risk, so the ledger counts no oom_risk.
    path = build_bundle(db, run_id, "oom", tmp_path / "out", cap_bytes=size + 1000, identity={"k8s_pod": "pod-9"},
                        log_tail=os.urandom(100_000), config=DetectorConfig(oom_margin_min_bytes=1),
                        clock=lambda: MOMENT)
    assert path == tmp_path / "out" / f"memwatch-incident-{STAMP}-pod-9-{run_id}.tar.gz"
    members = _members(path)
    made = m.parse_manifest(members[m.MANIFEST])
    assert (made.created_ns, made.trigger, made.identity["k8s_pod"]) == (MOMENT, "oom", "pod-9")
    assert made.dropped == ("sidecar log tail cut",) and m.LOG not in members  # over its cap with the log
    counts = json.loads(members[m.LEDGER])["run"]["flag_counts"]
    assert counts == {"activation_over_reserve": 1, "alloc_retries": 1, "oom": 1}
    kept = build_bundle(db, run_id, "manual", tmp_path / "out", log_tail=b"last line\n", clock=lambda: MOMENT)
    host = db.execute("SELECT hostname FROM runs").fetchone()[0]
    assert kept.name == path.name.replace("pod-9", host)  # no pod given: the run's host
    assert _members(kept)[m.LOG] == b"last line\n"


def test_the_build_needs_no_working_directory_and_runs_in_threads_named_for_it(
        run: tuple[Database, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pod's working directory may be anything, read-only or gone: here one removed after entering it. A stack
    # dump of the sidecar names the build's threads: its own pool's, and no other (the tar is compressed in it).
    db, run_id = run
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    before = {thread.name for thread in threading.enumerate()}
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(thread.name for thread in threading.enumerate())
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, name="watcher")
    watcher.start()
    try:
        built = _build_at(db, run_id, tmp_path / "out", created_ns=MOMENT)
    finally:
        stop.set()
        watcher.join(timeout=60)
    assert built.manifest.verdict == "oom" and os.listdir(tmp_path / "out") == [built.name]
    assert {re.sub(r"_\d+$", "", name) for name in seen - before - {"watcher"}} == {"memwatch-bundle"}


def test_over_the_cap_the_window_shortens_first_then_the_log_goes(tmp_path: Path) -> None:
    # One rank at 100 steps/s for 30 s (samples from 0 to 29.99 s, the run ending at 30 s).
    run_id = _long_run(tmp_path / "long.db", seconds=30, ranks=1)
    db = open_store(tmp_path / "long.db", readonly=True)
    try:
        whole = build(db, run_id, "manual", tmp_path / "whole", clock=lambda: MOMENT)
        size = whole.path.stat().st_size
        assert whole.manifest.window == {"full_from_ns": START_NS, "full_seconds_dropped": 0}
        # Three quarters: the window is cut to 0.8 x 29.99 s x 3/4, about 18 s, by whole seconds: 11 rolled up.
        most = build(db, run_id, "manual", tmp_path / "most", cap_bytes=size * 3 // 4, clock=lambda: MOMENT)
        assert most.path.stat().st_size <= size * 3 // 4
        assert most.manifest.window == {"full_from_ns": START_NS + 11 * 10**9, "full_seconds_dropped": 11}
        # Half: cut to about 12 s, then to the shortest window, 10 s before the run's end: 19 seconds rolled up.
        cut = build(db, run_id, "manual", tmp_path / "cut", cap_bytes=size // 2, clock=lambda: MOMENT)
        assert cut.path.stat().st_size <= size // 2
        assert cut.manifest.window == {"full_from_ns": START_NS + 19 * 10**9, "full_seconds_dropped": 19}
        assert cut.manifest.dropped == ("full-resolution window shortened",)
        (tmp_path / "run.db").write_bytes(_members(cut.path)[m.DATABASE])
        bundled = open_store(tmp_path / "run.db", readonly=True)
        try:
            assert bundled.execute("SELECT count(*) FROM sample_seconds").fetchone() == (19,)
            kept = bundled.execute("SELECT count(*), min(ts_ns) FROM samples").fetchone()
            assert kept == (1100, START_NS + 19 * 10**9)  # 11 s of 100 samples a second
        finally:
            bundled.conn.close()
        # With a log that cannot be compressed: the window first, as far as that, then the log.
        log = os.urandom(LOG_TAIL_BYTES)
        both = build(db, run_id, "manual", tmp_path / "both", cap_bytes=size // 2, log_tail=log, clock=lambda: MOMENT)
        assert both.manifest.dropped == ("full-resolution window shortened", "sidecar log tail cut")
        assert both.manifest.window == cut.manifest.window and m.LOG not in _members(both.path)
        # A quarter: cut to the shortest window (10 s before the end: the same 19 seconds), the log gone, still over.
        with pytest.raises(BundleTooLarge) as raised:
            build(db, run_id, "manual", tmp_path / "never", cap_bytes=size // 4, log_tail=log, clock=lambda: MOMENT)
        assert str(raised.value) == (f"the bundle of run long is {both.path.stat().st_size:,} bytes with only 10 s at "
                                     f"full resolution, over the cap of {size // 4:,} bytes; raise the cap")
        assert os.listdir(tmp_path / "never") == []
    finally:
        db.conn.close()


def test_a_thousand_names_taken_stop_the_build_with_its_folder_named(run: tuple[Database, str], tmp_path: Path) -> None:
    db, run_id = run
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    host = db.execute("SELECT hostname FROM runs").fetchone()[0]
    for later in range(1000):  # every millisecond from .123 to 1.122 s taken, by links to nothing
        second, milli = divmod(123 + later, 1000)
        (out / f"memwatch-incident-20270115T0800{second:02d}.{milli:03d}Z-{host}-{run_id}.tar.gz").symlink_to(
            tmp_path / "nothing")
    with pytest.raises(MemwatchError) as raised:
        _build_at(db, run_id, out, created_ns=MOMENT)
    first = f"memwatch-incident-{STAMP}-{host}-{run_id}.tar.gz"
    assert str(raised.value) == f"a thousand bundles named like {first} are already in {out}"
    assert len(os.listdir(out)) == 1000  # nothing added, no part left
