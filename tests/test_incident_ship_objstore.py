"""memwatch.incident.objstore against a local folder, obstore's in-memory store and a real S3 API (moto, loopback)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from memwatch.errors import NotFoundError, UnavailableError, UsageError
from memwatch.incident import objstore

from ship_s3 import S3Server, free_port

NAME = "memwatch-incident-20261204T012345Z-pod-a-run1.tar.gz"


@pytest.fixture
def s3(monkeypatch):
    server = S3Server(free_port()).start()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    server.bucket = f"bundles-{uuid.uuid4().hex[:12]}"  # moto's backend outlives one test: a bucket of its own
    server.client().create_bucket(Bucket=server.bucket)
    yield server
    server.stop()


def _prefix(kind: str, tmp_path: Path, bucket: str = "") -> str:
    return {"file": f"file://{tmp_path}/incidents", "path": f"{tmp_path}/incidents",
            "memory": f"memory:///{tmp_path.name}/incidents", "s3": f"s3://{bucket}/incidents"}[kind]


@pytest.mark.parametrize("kind", ["file", "path", "memory", "s3"])
def test_put_fetch_list_and_put_if_absent(kind, tmp_path, request):
    bucket = request.getfixturevalue("s3").bucket if kind == "s3" else ""
    bundle = tmp_path / NAME
    bundle.write_bytes(b"x" * 1000)
    prefix = _prefix(kind, tmp_path, bucket)
    url = f"{prefix}/{NAME}"
    objstore.put(url, bundle)
    objstore.put(url, bundle)  # the same bytes again: done before, not a second copy
    names = objstore.list_names(prefix)
    assert len(names) == 1 and names[0].endswith("/incidents/" + NAME)
    assert objstore.fetch(names[0], 1000) == b"x" * 1000  # exactly at the limit is allowed
    with pytest.raises(UsageError, match="1000 bytes, over the 999-byte limit") as over:
        objstore.fetch(url, 999)
    assert over.value.exit_code == 2
    other = tmp_path / "other.tar.gz"
    other.write_bytes(b"y" * 10)
    with pytest.raises(UsageError, match=r"already holds another object \(1000 bytes, not 10\)"):
        objstore.put(url, other)
    assert objstore.fetch(url, 1000) == b"x" * 1000  # never overwritten
    with pytest.raises(NotFoundError) as missing:
        objstore.fetch(f"{prefix}/absent.tar.gz", 1000)
    assert missing.value.exit_code == 3


def test_s3_object_is_visible_to_a_second_client(s3, tmp_path):
    bundle = tmp_path / NAME
    bundle.write_bytes(b"abc")
    objstore.put(f"s3://{s3.bucket}/a/b/{NAME}", bundle)
    assert s3.keys(s3.bucket) == [f"a/b/{NAME}"]
    assert s3.client().get_object(Bucket=s3.bucket, Key=f"a/b/{NAME}")["Body"].read() == b"abc"


def test_unreachable_store_is_one_line_and_bounded(monkeypatch, tmp_path):
    # Nothing listens on the port: connection refused, retried MAX_RETRIES times with back-off of at most
    # 0.2 s, 0.4 s; 10 s is a generous bound well under obstore's own defaults (10 retries, 3 minutes).
    from ship_s3 import CREDENTIALS

    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}.items():
        monkeypatch.setenv(key, value)
    bundle = tmp_path / NAME
    bundle.write_bytes(b"abc")
    start = time.monotonic()
    with pytest.raises(UnavailableError, match="unreachable") as down:
        objstore.put(f"s3://bundles/{NAME}", bundle)
    assert time.monotonic() - start < 10
    assert down.value.exit_code == 4 and "\n" not in str(down.value)


@pytest.mark.parametrize("url", ["ftp://host/x", "s3:///key", "file://otherhost/x", "memory:///x?y=1", ""])
def test_bad_urls_are_usage_errors(url):
    with pytest.raises(UsageError):
        objstore.parse(url)


def test_without_obstore_one_line_says_what_to_install(tmp_path):
    code = ("import sys; sys.modules['obstore'] = None\n"
            "from memwatch.incident import objstore\n"
            "from memwatch.errors import UnavailableError\n"
            "try:\n    objstore.list_names(sys.argv[1])\nexcept UnavailableError as e:\n"
            "    print(e.exit_code, e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("4 install memwatch[bundles]"), out


def test_base_commands_never_import_obstore():
    code = ("import sys, memwatch.cli, memwatch.cli.serve, memwatch.sidecar.daemon, memwatch.incident.ship\n"
            "import memwatch.export.pipeline, memwatch.incident.open\n"
            "print('obstore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out


def test_a_listing_past_its_bound_is_refused_as_too_wide(tmp_path, monkeypatch):
    # Three objects against a bound of 2: the names are input from elsewhere, never read without end.
    folder = tmp_path / "incidents"
    folder.mkdir()
    for n in range(3):
        (folder / f"b{n}.tar.gz").write_bytes(b"x")
    monkeypatch.setattr(objstore, "MAX_LISTED", 2)
    with pytest.raises(UsageError, match="more than 2 objects under") as wide:
        objstore.list_names(f"file://{folder}")
    assert wide.value.exit_code == 2
    monkeypatch.setattr(objstore, "MAX_LISTED", 3)
    assert len(objstore.list_names(f"file://{folder}")) == 3  # exactly at the bound is listed
