"""The shipper's rules in process, on a clock of the test's own: back-off, which bundle goes first, refusals, the
last pass's budget, and what a bundle's manifest tells (the termination message: test_incident_termination_log.py).

Real parts throughout: a :class:`Spool` in ``tmp_path``, ``file://`` destinations (obstore's LocalStore), moto's S3
on loopback where a put must hang, bundles from the bundle builder (tests/bundle_forge.py) or written here. A
destination under a regular file is a store that is down (every put fails); a folder under a bundle's name in the
destination fails that bundle alone.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from bundle_forge import real_members
from stuck_key import StuckKey
from test_incident_ship import make_bundle

from memwatch.errors import UsageError
from memwatch.incident import objstore
from memwatch.incident.ship import MANIFEST_LIMIT, Shipped, Shipper, bundle_facts, try_budget
from memwatch.incident.spool import Spool
from memwatch_engine.dirfd import private_dir

from processes import wait_for
from ship_s3 import S3Server, free_port

LOGGER = "memwatch.incident"


class Clock:
    """The shipper's clock: seconds the test sets."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def box(tmp_path: Path):  # type: ignore[no-untyped-def]
    state = private_dir(tmp_path / "state")
    made = Spool(state, tmp_path / "state")
    yield made
    made.close()
    os.close(state)


def spooled(box: Spool, run: str, age_s: int) -> str:
    """A bundle left in the spool by an earlier sidecar, written at ``age_s`` on the spool's clock: its name."""
    path = make_bundle(box.path, run=run)
    os.utime(path, ns=(age_s * 1_000_000_000,) * 2)
    return path.name


def logged(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= level]


def test_a_try_may_take_30_s_plus_the_bundle_at_128_kib_per_s() -> None:
    assert try_budget(0) == 30.0
    assert try_budget(128 * 1024) == 31.0
    assert try_budget(64 << 20) == 30.0 + 512.0
    assert try_budget(1) == 30.0 + 1 / 131072


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    return real_members(tmp_path_factory.mktemp("real"))


def _tar(members: list[tuple[str, bytes | None]]) -> io.BytesIO:
    """A tar.gz of ``members`` in that order (``None``: a folder of that name)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    out.seek(0)
    return out


def _manifest(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_bundle_facts_of_a_real_bundle_and_of_malformed_ones(real: tuple[str, dict[str, bytes]]) -> None:
    run_id, members = real
    whole = [(name, members[name]) for name in members]
    assert bundle_facts(_tar(whole)) == ("ok", "manual", run_id)  # clean_chat, built with trigger "manual"
    unknown = ("unknown", "unknown", "unknown")
    assert bundle_facts(io.BytesIO(_tar(whole).getvalue()[:40])) == unknown  # cut short in the gzip header
    manifest = _manifest(verdict="oom", trigger="crashed", run_id="r1")
    # The manifest is looked for among the first 16 members only: the 16th is read, the 17th is not.
    others = [(f"x{i}.json", _manifest(verdict="no")) for i in range(16)]
    assert bundle_facts(_tar([*others[:15], ("manifest.json", manifest)])) == ("oom", "crashed", "r1")
    assert bundle_facts(_tar([*others, ("manifest.json", manifest)])) == unknown
    assert bundle_facts(_tar([("manifest.json", None), ("run.db", b"x")])) == unknown  # a folder is no manifest
    # Up to 256 KiB is read; one byte more is not.
    padded = manifest[:-1] + b" " * (MANIFEST_LIMIT - len(manifest)) + b"}"
    assert len(padded) == MANIFEST_LIMIT and bundle_facts(_tar([("manifest.json", padded)])) == ("oom", "crashed", "r1")
    assert bundle_facts(_tar([("manifest.json", padded[:-1] + b" }")])) == unknown
    assert bundle_facts(_tar([("manifest.json", b"[1, 2]")])) == unknown
    assert bundle_facts(_tar([("manifest.json", b"{not json")])) == unknown
    odd = _manifest(verdict=7, trigger="", run_id="r" * 300)
    assert bundle_facts(_tar([("manifest.json", odd)])) == ("unknown", "unknown", "r" * 200)
    assert bundle_facts(_tar([("manifest.json", _manifest(verdict="problems"))])) == ("problems", "unknown", "unknown")
    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w") as tar:  # a tar not gzipped is no bundle
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    plain.seek(0)
    assert bundle_facts(plain) == unknown


def test_a_store_that_is_down_is_tried_again_after_1_2_4_then_4_s(box: Spool, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock()
    down = tmp_path / "down"
    down.write_text("a file where the destination's parent should be")
    dest = f"file://{down}/shipped"
    name = spooled(box, "r1", 10)
    shipper = Shipper(dest, box, first_backoff=1, max_backoff=4, rescan=5, clock=clock)
    waits = []
    for now in (100, 100.5, 101, 103, 105, 107, 111):
        clock.now = now
        waits.append(shipper.ship_due())
    # Tried at 100, 101 (not yet at 100.5), 103, 107 (not yet at 105) and 111: 1, 2, 4 s, then 4 s, the cap.
    assert waits == [1.0, 0.5, 2.0, 4.0, 2.0, 4.0, 4.0]
    assert shipper.attempts == 5 and shipper.failures == 5 and box.pending() == [name]
    down.unlink()
    clock.now = 111.5  # back-off not run out
    assert shipper.ship_due() == 3.5 and shipper.attempts == 5
    clock.now = 115
    assert shipper.ship_due() == 5.0  # shipped: nothing due before the next rescan
    assert shipper.attempts == 6 and shipper.failures == 5 and shipper.shipped_count == 1 and box.pending() == []
    assert objstore.list_names(dest) == [f"{dest}/{name}"]
    # The same bundle spooled again (its put now fails): a back-off of its own from 1 s, and the failure told again.
    body = (tmp_path / "down" / "shipped" / name).read_bytes()
    (tmp_path / "down" / "shipped" / name).unlink()
    (tmp_path / "down" / "shipped" / name).mkdir()
    (box.path / name).write_bytes(body)
    for now in (120, 121):
        clock.now = now
        shipper.ship_due()
    assert shipper.failures == 7
    assert logged(caplog) == [
        f"cannot ship bundles to {dest} yet (cannot use {down}/shipped: Not a directory); retrying with back-off, "
        "nothing is lost",
        f"shipping bundles to {dest} again",
        f"run r1: incident bundle shipped to {dest}/{name} (oom, oom)",
        f"cannot ship bundles to {dest} yet (no such object: {dest}/{name}); retrying with back-off, nothing is lost"]


def test_bundles_never_tried_go_before_those_that_failed_oldest_first_within_each(box: Spool, tmp_path: Path) -> None:
    clock = Clock()
    dest = tmp_path / "shipped"
    failed = [spooled(box, "a", 10), spooled(box, "b", 20)]
    for name in failed:
        (dest / name).mkdir(parents=True)  # that bundle's put fails
    shipper = Shipper(f"file://{dest}", box, clock=clock)
    assert shipper.ship_due() == 1.0 and shipper.failures == 2
    for name in failed:
        (dest / name).rmdir()
    spooled(box, "c", 30)
    spooled(box, "d", 5)
    clock.now = 101
    assert shipper.ship_due() == 5.0
    assert [s.run_id for s in shipper.shipped] == ["d", "c", "a", "b"] and shipper.shipped_count == 4


def test_a_bundle_still_in_back_off_holds_back_none_behind_it(box: Spool, tmp_path: Path) -> None:
    clock = Clock()
    dest = tmp_path / "shipped"
    older = spooled(box, "a", 10)
    (dest / older).mkdir(parents=True)
    shipper = Shipper(f"file://{dest}", box, clock=clock)
    shipper.ship_due()  # "a" fails at 100: due at 101
    clock.now = 101
    newer = spooled(box, "b", 20)
    (dest / newer).mkdir()
    shipper.ship_due()  # "b" fails for the first time (due at 102), "a" again (due at 103)
    (dest / newer).rmdir()
    clock.now = 102
    assert shipper.ship_due() == 1.0  # "a", first in line, waits till 103; "b" behind it is due, and shipped
    assert [s.run_id for s in shipper.shipped] == ["b"] and shipper.attempts == 4


def test_another_object_under_the_name_is_refused_once_and_never_overwritten(box: Spool, tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    dest = tmp_path / "shipped"
    dest.mkdir()
    taken, again = spooled(box, "a", 10), spooled(box, "b", 20)
    (dest / taken).write_bytes(b"someone else's")
    (dest / again).write_bytes((box.path / again).read_bytes())  # uploaded before a crash kept it in the spool
    size = (box.path / taken).stat().st_size
    shipper = Shipper(f"file://{dest}", box, clock=clock)
    assert shipper.ship_due() == 5.0  # nothing to try again: the refused one has no back-off
    assert [s.name for s in shipper.shipped] == [again] and box.pending() == [taken]
    later = spooled(box, "c", 30)
    clock.now = 1000
    assert shipper.ship_due() == 5.0
    assert [s.name for s in shipper.shipped] == [again, later] and box.pending() == [taken]
    assert shipper.attempts == 3 and shipper.failures == 0
    assert shipper._ship_one(taken) is False  # tried once more by hand: not done, still not overwritten
    assert (dest / taken).read_bytes() == b"someone else's"
    assert len(logged(caplog, logging.ERROR)) == 2
    assert logged(caplog, logging.ERROR)[:1] == [
        f"bundle {taken} not shipped: file://{dest}/{taken} already holds another object (14 bytes, not {size}); not "
        f"overwritten; it stays in {box.path}"]


def test_a_spool_entry_that_cannot_be_read_is_refused_once_and_a_vanished_one_is_done(
        box: Spool, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shipper = Shipper(f"file://{tmp_path}/shipped", box, clock=Clock())
    assert shipper._ship_one("memwatch-incident-20261204T012300Z-pod-a-gone.tar.gz") is True
    name = "memwatch-incident-20261204T012300Z-pod-a-fifo.tar.gz"
    os.mkfifo(box.path / name)
    assert shipper._ship_one(name) is False
    os.unlink(box.path / name)
    make_bundle(tmp_path / "out").rename(box.path / name)  # a bundle under that name now: still refused
    assert shipper.ship_due() == 5.0
    assert shipper.attempts == 0 and shipper.failures == 0 and box.pending() == [name]
    assert logged(caplog, logging.ERROR) == [
        f"bundle {name} in the spool cannot be read (not a regular file (a FIFO)); left there"]


def test_each_bundle_is_announced_as_its_manifest_says_even_when_an_announcer_fails(
        box: Spool, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Shipped] = []

    def broken(shipped: Shipped) -> None:
        raise RuntimeError("collector gone")

    with pytest.raises(UsageError):
        Shipper("ftp://host/x", box)
    shipper = Shipper(f"file://{tmp_path}/X//", box, [broken, seen.append], clock=Clock())  # only "/" is stripped
    built = make_bundle(tmp_path / "out", run="r9", verdict="problems", trigger="crashed")
    body = built.read_bytes()
    shipper.enqueue(built)
    assert box.pending() == [built.name] and not built.exists()
    assert shipper.ship_due() == 5.0
    url = f"file://{tmp_path}/X/{built.name}"
    assert seen == [Shipped(built.name, url, "problems", "r9", len(body), "crashed")] == shipper.shipped
    assert seen[0].line() == f"problems (crashed) {url}" and Shipped("n", "u", "v", "r", 1).trigger == "unknown"
    assert (tmp_path / "X" / built.name).read_bytes() == body and box.pending() == []
    assert shipper.attempts == 1 and shipper.shipped_count == 1
    assert logged(caplog, logging.ERROR) == [f"bundle {built.name} shipped but not announced: collector gone"]


def test_the_shipped_list_keeps_the_newest_over_1024_and_the_count_goes_on(box: Spool, tmp_path: Path) -> None:
    shipper = Shipper(f"file://{tmp_path}/shipped", box, clock=Clock())
    for i in range(1025):
        (box.path / f"memwatch-incident-{i:05d}.tar.gz").write_bytes(b"x")  # not a bundle inside: shipped even so
        if i == 1023:
            shipper.ship_due()
            assert len(shipper.shipped) == 1024 and shipper.shipped_count == 1024
    shipper.ship_due()
    # The 1,025th: the oldest 512 dropped from the list, 513 left, the newest last.
    assert len(shipper.shipped) == 513 and shipper.shipped_count == 1025
    assert shipper.shipped[0].name == "memwatch-incident-00512.tar.gz" and shipper.shipped[-1].verdict == "unknown"


def test_the_last_pass_tries_every_bundle_once_until_its_budget_is_spent(box: Spool, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    down = tmp_path / "down"
    down.write_text("")
    names = [spooled(box, run, age) for run, age in (("a", 10), ("b", 20), ("c", 30), ("d", 40))]

    def upload_takes_3_s(shipped: Shipped) -> None:
        clock.now += 3

    shipper = Shipper(f"file://{down}/shipped", box, [upload_takes_3_s], clock=clock)
    assert shipper.ship_due() == 1.0 and shipper.failures == 4  # the store is down: all four wait for 101
    down.unlink()
    caplog.clear()
    # Back-off is not waited for. Budget 6.5 s from 100: "a" at 100, "b" at 103, "c" at 106 (0.5 s left); at 109
    # none is left for "d".
    shipper.close(budget_s=6.5)
    assert [s.run_id for s in shipper.shipped] == ["a", "b", "c"] and box.pending() == [names[3]]
    assert shipper.attempts == 7
    clock.now = 200
    assert shipper.ship_due() == 5.0  # stopped: the shipper's own passes try nothing more
    assert shipper.attempts == 7 and box.pending() == [names[3]]
    other = Shipper(f"file://{down}/shipped", box, clock=clock)
    other.close(budget_s=0)  # no time at all: nothing tried
    assert other.ship_due(deadline=200) == 5.0 and other.attempts == 0 and box.pending() == [names[3]]
    assert logged(caplog)[:4] == [
        f"shipping bundles to file://{down}/shipped again",
        f"run a: incident bundle shipped to file://{down}/shipped/{names[0]} (oom, oom)",
        f"run b: incident bundle shipped to file://{down}/shipped/{names[1]} (oom, oom)",
        f"run c: incident bundle shipped to file://{down}/shipped/{names[2]} (oom, oom)"]
    assert logged(caplog)[4:] == [
        f"1 incident bundle(s) not shipped yet; they stay in {box.path} and go at the next start"] * 2


def test_the_thread_ships_what_is_spooled_at_once_and_retries_on_its_own(box: Spool, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    down = tmp_path / "down"
    down.write_text("")
    shipper = Shipper(f"file://{down}/shipped", box, first_backoff=0.05, max_backoff=0.05, rescan=60)
    shipper.start()
    assert shipper._thread is not None and shipper._thread.name == "memwatch-shipper" and shipper._thread.daemon
    time.sleep(0.2)  # its first pass found nothing: it waits for a wake-up or 60 s
    shipper.enqueue(make_bundle(tmp_path / "out"))
    wait_for(lambda: shipper.failures >= 3, timeout=10, what="tries after the back-off, with no wake-up")
    down.unlink()
    wait_for(lambda: shipper.shipped_count == 1, timeout=10, what="the upload once the store is back")
    shipper.close(budget_s=5)
    assert not shipper._thread.is_alive() and box.pending() == []
    assert not [m for m in logged(caplog) if "given up" in m or "not shipped yet" in m]


def test_a_bug_on_the_thread_stops_the_uploads_never_the_sidecar(box: Spool, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> float:
        raise RuntimeError("clock broke")

    shipper = Shipper(f"file://{tmp_path}/shipped", box, clock=broken)
    shipper.start()
    assert shipper._thread is not None
    shipper._thread.join(timeout=10)
    assert not shipper._thread.is_alive()
    assert logged(caplog, logging.ERROR) == [
        f"the bundle shipper stopped; bundles stay in {box.path} for the next start"]


@pytest.fixture
def stalled(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """moto's S3 where the first bundle's put never answers."""
    stuck = StuckKey("stall")
    server = S3Server(free_port(), wrap=stuck.wrap).start()
    bucket = f"bundles-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=bucket)
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    try:
        yield bucket, stuck
    finally:
        stuck.release()
        server.stop()


def test_a_put_the_store_hangs_on_ends_with_the_last_passs_budget(stalled, box: Spool) -> None:  # type: ignore[no-untyped-def]
    bucket, stuck = stalled
    name = spooled(box, "a", 10)
    shipper = Shipper(f"s3://{bucket}/incidents", box)
    started = time.monotonic()
    shipper.close(budget_s=1.5)  # a try of its own would wait 30 s
    took = time.monotonic() - started
    assert len(stuck.tries) >= 1 and shipper.failures == 1 and box.pending() == [name]
    assert 1.0 < took < 8.0, took


def test_a_try_in_flight_on_the_thread_is_left_to_it_and_the_others_get_the_last_pass(
        box: Spool, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()

    def held_on_the_thread(shipped: Shipped) -> None:  # the shipper's own try hangs until the test ends
        if threading.current_thread().name == "memwatch-shipper":
            gate.wait(20)

    dest = f"file://{tmp_path}/shipped"
    first = spooled(box, "a", 10)
    shipper = Shipper(dest, box, [held_on_the_thread], rescan=60, clock=Clock())
    shipper.start()
    wait_for(lambda: shipper.attempts == 1, timeout=10, what="the thread's try")
    second = make_bundle(tmp_path / "out", run="b")
    box.enqueue(second)
    caplog.clear()
    started = time.monotonic()
    try:
        shipper.close(budget_s=0.4)  # the clock stands still: the thread is waited for 0.4 s
        took = time.monotonic() - started
        shipped, pending = [s.run_id for s in shipper.shipped], box.pending()
    finally:
        gate.set()
    assert shipper._thread is not None
    shipper._thread.join(timeout=10)
    assert 0.4 <= took < 0.95, took
    assert shipper.attempts == 2 and shipped == ["b"] and pending == [first]
    assert shipper.shipped_count == 2 and box.pending() == []  # the thread's try, let go, finished
    assert logged(caplog) == [
        f"run b: incident bundle shipped to {dest}/{second.name} (oom, oom)",
        "an upload try still in flight after 0 s is given up; its bundle stays",
        f"1 incident bundle(s) not shipped yet; they stay in {box.path} and go at the next start"]
