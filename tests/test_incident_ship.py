"""The spool and the shipper: nothing lost while the store is down, nothing uploaded twice, each bundle announced.

The bundles here are small stand-ins with the real name and a ``manifest.json`` first, as the bundle builder writes
them; the store is moto's S3 on loopback (tests/ship_s3.py), a local folder, or obstore's in-memory store.
"""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from memwatch.errors import UsageError
from memwatch.incident import objstore, spool
from memwatch.incident.ship import TERMINATION_LIMIT, Shipped, Shipper, TerminationMessage, bundle_facts

from processes import wait_for
from ship_s3 import S3Server, free_port


def make_bundle(folder: Path, run: str = "run1", verdict: str = "oom", size: int = 2000, trigger: str = "oom") -> Path:
    """A stand-in bundle: ``manifest.json`` then a payload of ``size`` random bytes (so gzip keeps it that big)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"memwatch-incident-20261204T0123{len(list(folder.iterdir())):02d}Z-pod-a-{run}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        manifest = {"run_id": run, "verdict": verdict, "trigger": trigger}
        for name, data in (("manifest.json", json.dumps(manifest).encode()),
                           ("run.db", os.urandom(size))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def s3_down(monkeypatch):
    """The store's address with nothing listening yet; ``.start()`` brings moto's S3 up there."""
    server = S3Server(free_port())
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    server.bucket = f"bundles-{uuid.uuid4().hex[:12]}"
    yield server
    server.stop()


def up(server: S3Server) -> None:
    server.start()
    server.client().create_bucket(Bucket=server.bucket)


def test_the_spool_is_private_and_takes_only_bundles(state, tmp_path):
    fd, shown = state
    box = spool.Spool(fd, shown)
    assert stat.S_IMODE(os.fstat(box.fd).st_mode) == 0o700
    bundle = make_bundle(tmp_path / "out")
    box.enqueue(bundle)
    assert not bundle.exists() and box.pending() == [bundle.name]
    stray = tmp_path / "out" / "notes.txt"
    stray.write_text("x")
    with pytest.raises(UsageError, match="not an incident bundle's name"):
        box.enqueue(stray)
    (shown / "bundles" / f".{bundle.name}.tmp").write_bytes(b"half a copy")  # a copy cut short by a kill
    box.close()
    again = spool.Spool(fd, shown)
    assert os.listdir(again.fd) == [bundle.name]
    again.close()


def test_enqueue_without_a_sidecar_leaves_the_bundle_where_it_was_built(tmp_path):
    bundle = make_bundle(tmp_path / "out")
    spool.enqueue(bundle)
    assert bundle.exists()


def test_bundle_facts_reads_the_manifest(tmp_path):
    bundle = make_bundle(tmp_path, run="r7", verdict="problems", trigger="crashed")
    with open(bundle, "rb") as f:
        assert bundle_facts(f) == ("problems", "crashed", "r7")
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x1f\x8b not really gzip")
    with open(junk, "rb") as f:
        assert bundle_facts(f) == ("unknown", "unknown", "unknown")


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_ships_to_a_folder_and_to_memory_then_empties_the_spool(kind, state, tmp_path):
    fd, shown = state
    # The memory store is the process's: a prefix of its own, so a second session in one process (mutmut) starts empty.
    dest = f"file://{tmp_path}/shipped" if kind == "file" else f"memory:///{uuid.uuid4().hex}"
    box = spool.Spool(fd, shown)
    seen: list[Shipped] = []
    shipper = Shipper(dest, box, [seen.append])
    shipper.start()
    bundle = make_bundle(tmp_path / "out", run="r1", verdict="oom")
    shipper.enqueue(bundle)
    wait_for(lambda: seen, timeout=10, what="the upload")
    shipper.close(budget_s=5)
    assert [(s.uri, s.verdict, s.run_id) for s in seen] == [(f"{dest}/{bundle.name}", "oom", "r1")]
    assert objstore.list_names(dest) == [f"{dest}/{bundle.name}"]
    assert box.pending() == []
    box.close()


def test_a_bundle_built_while_the_store_is_down_is_uploaded_once_it_returns(s3_down, state, tmp_path, monkeypatch):
    monkeypatch.setattr(objstore, "MAX_RETRIES", 0)  # one request per try: the tries below are the shipper's alone
    fd, shown = state
    box = spool.Spool(fd, shown)
    shipper = Shipper(f"s3://{s3_down.bucket}/incidents/", box, first_backoff=0.2, max_backoff=0.4, rescan=1.0)
    shipper.start()
    shipper.enqueue(make_bundle(tmp_path / "out"))
    time.sleep(2.0)
    # Down for 2 s: tries at 0, 0.2, 0.6 (back-off doubled to 0.4, its cap), 1.0, 1.4, 1.8 s, each refused at once
    # (connection refused): 6 tries. At least 3 shows it retries on a loaded machine; at most 7 shows the back-off
    # (without it, a refused connection is retried thousands of times in 2 s).
    assert 3 <= shipper.attempts <= 7
    assert box.pending() != []
    up(s3_down)
    wait_for(lambda: not box.pending(), timeout=10, what="the upload once the store is back")
    assert s3_down.keys(s3_down.bucket) == [f"incidents/{shipper.shipped[0].name}"]
    shipper.close(budget_s=5)
    box.close()


def test_after_a_restart_the_spool_is_shipped_and_nothing_twice(s3_down, state, tmp_path):
    fd, shown = state
    dest = f"s3://{s3_down.bucket}/incidents"
    first = Shipper(dest, spool.Spool(fd, shown), first_backoff=5, rescan=5)
    first.start()
    built = [make_bundle(tmp_path / "out", run=f"r{i}") for i in range(2)]
    for path in built:
        first.enqueue(path)
    t0 = time.monotonic()
    first.close(budget_s=1.0)  # the sidecar stops while the store is down: the bundles stay in the spool
    assert time.monotonic() - t0 < 3.0
    assert len(first.spool.pending()) == 2
    first.spool.close()
    up(s3_down)
    # One of them reached the store before the crash that kept it in the spool (put, then killed before the delete).
    spooled = shown / "bundles" / built[0].name
    s3_down.client().put_object(Bucket=s3_down.bucket, Key=f"incidents/{built[0].name}", Body=spooled.read_bytes())
    box = spool.Spool(fd, shown)
    seen: list[Shipped] = []
    second = Shipper(dest, box, [seen.append])
    second.start()
    wait_for(lambda: len(seen) == 2, timeout=10, what="both bundles shipped after the restart")
    second.close(budget_s=5)
    assert s3_down.keys(s3_down.bucket) == sorted(f"incidents/{p.name}" for p in built)
    assert box.pending() == [] and second.attempts == 2
    box.close()


def test_another_object_under_the_name_is_never_overwritten_nor_retried(s3_down, state, tmp_path):
    fd, shown = state
    up(s3_down)
    bundle = make_bundle(tmp_path / "out")
    s3_down.client().put_object(Bucket=s3_down.bucket, Key=bundle.name, Body=b"someone else's")
    box = spool.Spool(fd, shown)
    shipper = Shipper(f"s3://{s3_down.bucket}", box, first_backoff=0.05, rescan=0.1)
    shipper.start()
    shipper.enqueue(bundle)
    time.sleep(0.5)
    shipper.close(budget_s=2)
    assert shipper.attempts == 1 and box.pending() == [bundle.name]
    body = s3_down.client().get_object(Bucket=s3_down.bucket, Key=bundle.name)["Body"].read()
    assert body == b"someone else's"
    box.close()


def test_the_termination_message_holds_the_newest_bundles_within_4_kib(tmp_path):
    log = tmp_path / "termination-log"
    log.write_text("")
    message = TerminationMessage(log)
    uri = "s3://bucket/" + "p" * 200 + "/memwatch-incident-x.tar.gz"
    for i in range(40):
        message(Shipped(f"b{i}", f"{uri}{i}", "oom", "r", 1, "oom"))
    text = log.read_text()
    lines = text.splitlines()
    # Each line is "memwatch incident: oom (oom) " (29) + the URI (239 + 1 or 2 digits) + "\n": 269 or 270 bytes,
    # so 15 of the newest fit in 4,096 (15 × 270 = 4,050; a 16th would make 4,320).
    assert len(text.encode()) <= TERMINATION_LIMIT and len(lines) == 15
    assert lines[-1] == f"memwatch incident: oom (oom) {uri}39" and lines[0].endswith(f"{uri}25")


def test_no_termination_file_no_termination_message(tmp_path):
    absent = tmp_path / "termination-log"
    TerminationMessage(absent)(Shipped("b", "file:///x", "oom", "r", 1))
    assert not absent.exists()
    TerminationMessage(tmp_path)(Shipped("b", "file:///x", "oom", "r", 1))  # a directory: never the sidecar's fault
