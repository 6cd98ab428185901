"""Bundles read where they were shipped: obstore's in-memory store and a real S3 API on loopback (moto).

Every reading command takes the bundle's URL as ``--db`` and answers as it does on the database it came from;
``memwatch incidents PREFIX`` lists the bundles there newest first, each by its manifest; one whose manifest is
damaged is listed as refused with exit 6, and one whose members were changed is refused when it is opened.
"""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.incident import objstore
from memwatch.incident.bundle import build_bundle
from memwatch.store import open_store

from ship_s3 import S3Server, free_port
from stored_runs import store_scenario


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[Path]]:
    """A database of two runs (an out-of-memory, then a clean one) and a bundle of each, the clean one newer."""
    root = tmp_path_factory.mktemp("urls")
    db_path = root / "memwatch.db"
    runs = []
    for name in ("long_prefill", "clean_chat"):
        runtime = root / name
        runtime.mkdir(mode=0o700)
        runs.append(store_scenario(name, runtime, db_path, live=True))
    db = open_store(db_path, readonly=True)
    clock = iter((1_800_000_000 * 10**9, 1_800_000_060 * 10**9))  # the OOM's bundle a minute older
    bundles = [build_bundle(db, run_id, "manual", root / "out", clock=lambda: next(clock)) for run_id in runs]
    db.conn.close()
    return db_path, runs[0], bundles


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _tampered(path: Path, member: str = "events.jsonl") -> bytes:
    """The bundle with one byte of ``member`` changed (of its events, by default), the rest kept."""
    out = io.BytesIO()
    with tarfile.open(path) as source, tarfile.open(fileobj=out, mode="w:gz") as target:
        for info in source:
            data = source.extractfile(info).read()  # type: ignore[union-attr]
            if info.name == member == "events.jsonl":
                data = data.replace(b"oom", b"ook", 1)
            elif info.name == member:
                data = b"[" + data[1:]
            target.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _check_prefix(prefix: str, stored: tuple[Path, str, list[Path]], tmp_path: Path) -> None:
    db_path, oom_run, bundles = stored
    for bundle in bundles:
        objstore.put(f"{prefix}/{bundle.name}", bundle)
    url = f"{prefix}/{bundles[0].name}"
    for command in (["explain", oom_run, "--json"], ["timeline", oom_run, "--json"], ["flags", oom_run, "--json"],
                    ["check", oom_run, "--json"], ["events", oom_run, "--json"]):
        assert _cli(*command, "--db", url) == _cli(*command, "--db", str(db_path))
    assert _cli("runs", "--json", "--db", url) == _cli("runs", "--json", "--db", str(bundles[0]))  # its one run
    code, out = _cli("explain", oom_run, "--json", "--db", url)
    assert json.loads(out)["outcome"] == "oom"
    code, out = _cli("incidents", prefix + "/", "--json")
    assert code == 0, out
    listed = [json.loads(line) for line in out.splitlines()]
    # Newest first: the clean run's bundle was made a minute after the OOM's.
    assert [(item["verdict"], item["model"], item["refused"]) for item in listed] == [
        ("ok", "Qwen3-0.6B", False), ("oom", "Qwen3-0.6B", False)]
    assert [item["uri"] for item in listed] == [f"{prefix}/{bundles[1].name}", url]
    forged = tmp_path / "memwatch-incident-20300101T000000Z-forged-x.tar.gz"
    forged.write_bytes(_tampered(bundles[0]))
    objstore.put(f"{prefix}/{forged.name}", forged)
    damaged = tmp_path / "memwatch-incident-20300101T000001Z-damaged-x.tar.gz"
    damaged.write_bytes(_tampered(bundles[0], "manifest.json"))
    objstore.put(f"{prefix}/{damaged.name}", damaged)
    code, out = _cli("incidents", prefix + "/")
    assert code == 6
    lines = out.strip().splitlines()
    assert len(lines) == 6  # the header, four entries, the error
    # The forged bundle's manifest is whole, so it is listed; its members are not read until it is opened.
    assert [line for line in lines if forged.name in line and " oom " in line and "REFUSED" not in line]
    assert "REFUSED: the bundle's manifest.json is not JSON" in lines[-2] and damaged.name in lines[-2]
    assert lines[-1] == (f"error: 1 of 4 entries under {prefix}/ were refused (not a bundle, or its manifest failed "
                         "its checks)")
    code, out = _cli("explain", oom_run, "--db", f"{prefix}/{forged.name}")
    assert code == 6 and "does not match its manifest's SHA-256" in out


def test_bundles_in_memory_read_and_list(stored: tuple[Path, str, list[Path]], tmp_path: Path) -> None:
    _check_prefix(f"memory:///incidents-{uuid.uuid4().hex[:8]}", stored, tmp_path)


def test_bundles_in_s3_read_and_list(stored: tuple[Path, str, list[Path]], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    server = S3Server(free_port()).start()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        bucket = f"incidents-{uuid.uuid4().hex[:12]}"
        server.client().create_bucket(Bucket=bucket)
        _check_prefix(f"s3://{bucket}/prod", stored, tmp_path)
    finally:
        server.stop()


def test_a_local_folder_lists_like_a_store(stored: tuple[Path, str, list[Path]]) -> None:
    _, _, bundles = stored
    code, out = _cli("incidents", f"file://{bundles[0].parent}", "--json")
    assert code == 0 and [json.loads(line)["verdict"] for line in out.splitlines()] == ["ok", "oom"]
    code, out = _cli("incidents", str(bundles[0].parent), "--limit", "1", "--json")  # the newest name only
    assert code == 0 and [json.loads(line)["verdict"] for line in out.splitlines()] == ["ok"]
