"""memwatch.incident.objstore in detail: how a URL is read, the URLs a listing gives back, ranged reads at an
object's end, streaming in bounded chunks, and each way a store can fail, as its one line and exit code.

Local folders and obstore's in-memory store are real; S3 is moto's real S3 API on loopback, behind a WSGI wrapper
where a test needs the store to refuse, or to say one size and send more; "hangs" is a socket that accepts and never
answers.
"""

from __future__ import annotations

import io
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memwatch.errors import MemwatchError, NotFoundError, PermissionDeniedError, UnavailableError, UsageError
from memwatch.incident import objstore
from memwatch.incident.objstore import Location

from ship_s3 import CREDENTIALS, S3Server, free_port

MIB = 1 << 20


def _serve(monkeypatch: pytest.MonkeyPatch, wrap: Callable[[Any], Any] | None = None) -> Iterator[str]:
    server = S3Server(free_port(), wrap=wrap).start()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    bucket = f"objs-{uuid.uuid4().hex[:12]}"  # moto's backend outlives one server: a bucket of its own
    server.client().create_bucket(Bucket=bucket)
    try:
        yield bucket
    finally:
        server.stop()


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    yield from _serve(monkeypatch)


def _denying(app: Any) -> Any:
    """The store answers 403 AccessDenied for every key with "denied" in it, as S3 does to credentials it refuses."""
    def app_or_403(environ: dict[str, Any], start_response: Any) -> Any:
        if "denied" in environ["PATH_INFO"]:
            start_response("403 Forbidden", [("Content-Type", "application/xml")])
            return [b'<?xml version="1.0" encoding="UTF-8"?>'
                    b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"]
        return app(environ, start_response)
    return app_or_403


def _understating(app: Any) -> Any:
    """GETs of keys ending in "grown" say Content-Length 10 and send the whole object (chunked): a store whose object
    grew after it said its size."""
    def lying(environ: dict[str, Any], start_response: Any) -> Any:
        if environ["REQUEST_METHOD"] != "GET" or not environ["PATH_INFO"].endswith("grown"):
            return app(environ, start_response)
        said: dict[str, Any] = {}
        body = b"".join(app(environ, lambda status, headers, exc_info=None: said.update(status=status,
                                                                                      headers=headers)))
        headers = [(k, v) for k, v in said["headers"] if k.lower() != "content-length"]
        start_response(said["status"], [*headers, ("Content-Length", "10"), ("Transfer-Encoding", "chunked")])
        return [b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"]
    return lying


def _cutting(app: Any) -> Any:
    """GETs of keys ending in "cut" send half the object, then close the connection: a store that fails mid-read."""
    def cut_short(environ: dict[str, Any], start_response: Any) -> Any:
        if environ["REQUEST_METHOD"] != "GET" or not environ["PATH_INFO"].endswith("cut"):
            return app(environ, start_response)
        said: dict[str, Any] = {}
        body = b"".join(app(environ, lambda status, headers, exc_info=None: said.update(status=status,
                                                                                      headers=headers)))
        headers = [(k, v) for k, v in said["headers"] if k.lower() != "content-length"]
        start_response(said["status"], [*headers, ("Content-Length", str(len(body))),
                                        ("Transfer-Encoding", "chunked"), ("Connection", "close")])
        return [b"%x\r\n" % len(body) + body[:len(body) // 2]]
    return cut_short


def _file(tmp_path: Path, data: bytes, name: str = "src.bin") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _raises(call: Callable[[], object], kind: type[MemwatchError], exit_code: int) -> str:
    """``call``'s one-line error of ``kind`` with ``exit_code``, as text."""
    with pytest.raises(kind) as caught:
        call()
    assert caught.value.exit_code == exit_code and "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize(("url", "scheme", "root", "key"), [
    ("S3://Bucket//a/b/", "s3", "s3://Bucket", "a/b/"),  # the scheme in any case; the key keeps its tail
    ("gs://b/k", "gs", "gs://b", "k"),
    ("az://container", "az", "az://container", ""),
    ("FILE:///srv/in%20cidents/x.tar.gz", "file", "/srv/in cidents/x.tar.gz", ""),
    ("file://localhost/srv/x", "file", "/srv/x", ""),
    ("file://", "file", "/", ""),
    ("memory://host/a/b/", "memory", "memory:///", "host/a/b"),
    ("memory:///", "memory", "memory:///", ""),
])
def test_a_url_splits_into_its_store_and_key(url: str, scheme: str, root: str, key: str) -> None:
    assert objstore.parse(url) == Location(scheme, root, key)


def test_a_plain_path_is_an_absolute_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert objstore.parse("rel/x.tar.gz") == Location("file", f"{tmp_path}/rel/x.tar.gz", "")
    assert objstore.parse("~/x.tar.gz") == Location("file", f"{tmp_path}/home/x.tar.gz", "")


@pytest.mark.parametrize(("url", "says"), [
    (None, "not a bundle URL: None"),
    ("a\x00b", "not a bundle URL: 'a\\x00b'"),
    ("ftp://host/x", "unsupported URL scheme 'ftp' in 'ftp://host/x': use a path, file://, s3://, gs:// or az://"),
    ("s3://b/k?versionId=1", "a bundle URL takes no query or fragment: 's3://b/k?versionId=1'"),
    ("s3://b/k#part", "a bundle URL takes no query or fragment: 's3://b/k#part'"),
    ("file://otherhost/x", "a file:// URL names no host: 'file://otherhost/x' (use file:///absolute/path)"),
    ("gs:///key", "'gs:///key' names no bucket or container (e.g. gs://bucket/incidents/)"),
])
def test_a_bad_url_says_what_is_wrong_with_it(url: Any, says: str) -> None:
    assert _raises(lambda: objstore.parse(url), UsageError, 2) == says


def test_a_location_writes_its_urls_back() -> None:
    assert Location("file", "/srv/in", "").url() == "file:///srv/in"
    assert Location("file", "/srv/in/", "").url() == "file:///srv/in/"  # as the user wrote it
    assert Location("file", "/srv/in", "").url("b/c.tar.gz") == "file:///srv/in/b/c.tar.gz"
    assert Location("memory", "memory:///", "k/l").url() == "memory:///k/l"
    assert Location("memory", "memory:///", "k").url("j") == "memory:///j"
    assert Location("s3", "s3://b", "k/l").url() == "s3://b/k/l"
    assert Location("s3", "s3://b", "").url() == "s3://b"
    assert Location("gs", "gs://b", "").url("x") == "gs://b/x"


@pytest.mark.parametrize("kind", ["file", "path", "memory", "s3"])
def test_a_listing_gives_every_object_below_as_a_url_that_fetches_it(kind: str, tmp_path: Path,
                                                                     request: pytest.FixtureRequest) -> None:
    src = _file(tmp_path, b"abc")
    if kind == "s3":
        bucket = request.getfixturevalue("bucket")
        base = prefix = f"s3://{bucket}/incidents"
    elif kind == "memory":
        base = prefix = f"memory:///{uuid.uuid4().hex}/incidents"
    else:
        base = f"file://{tmp_path}/incidents"
        prefix = base if kind == "file" else f"{tmp_path}/incidents"
    for name in ("b.tar.gz", "a.tar.gz", "sub/c.tar.gz"):
        objstore.put(f"{prefix}/{name}", src)
    expected = [f"{base}/a.tar.gz", f"{base}/b.tar.gz", f"{base}/sub/c.tar.gz"]  # sorted, the folder's too
    assert objstore.list_names(prefix) == expected
    assert objstore.list_names(prefix + "/") == expected
    if kind in ("memory", "s3"):
        assert objstore.list_names(prefix + "//") == expected
        objstore.put(f"{prefix}X/d.tar.gz", src)  # a prefix ending in X is that folder, not one without the X
        assert objstore.list_names(f"{prefix}X/") == [f"{base}X/d.tar.gz"]
    assert [objstore.fetch(url, 3) for url in expected] == [b"abc"] * 3
    if kind == "s3":
        objstore.put(f"s3://{bucket}/elsewhere.tar.gz", src)
        assert objstore.list_names(f"s3://{bucket}") == [f"s3://{bucket}/elsewhere.tar.gz", *expected,
                                                         f"{base}X/d.tar.gz"]
        gone = f"s3://{bucket}-gone/incidents"
        said = _raises(lambda: objstore.list_names(gone), UnavailableError, 4)
        assert said.startswith(f"{gone}: the store is unreachable or failed (") and "NoSuchBucket" in said


def test_a_listing_of_many_pages_lists_them_all() -> None:
    prefix = f"memory:///{uuid.uuid4().hex}"
    for n in range(120):  # a listing comes in pages of 50
        objstore.put_file(f"{prefix}/{n:03d}", io.BytesIO(b"x"), 1)
    assert objstore.list_names(prefix) == [f"{prefix}/{n:03d}" for n in range(120)]


def test_a_listing_past_its_bound_says_how_to_narrow_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for n in range(3):
        _file(tmp_path, b"x", f"b{n}.tar.gz")
    monkeypatch.setattr(objstore, "MAX_LISTED", 2)
    said = _raises(lambda: objstore.list_names(str(tmp_path)), UsageError, 2)
    assert said == f"more than 2 objects under {tmp_path}; give a narrower prefix (a day's or a pod's)"


def test_a_listing_of_a_missing_folder_is_not_found(tmp_path: Path) -> None:
    said = _raises(lambda: objstore.list_names(f"file://{tmp_path}/none"), NotFoundError, 3)
    assert said == f"no such folder: {tmp_path}/none"


@pytest.mark.parametrize("kind", ["file", "memory", "s3"])
def test_a_range_is_cut_at_the_objects_end_and_past_it_is_empty(kind: str, tmp_path: Path,
                                                                request: pytest.FixtureRequest) -> None:
    prefix = {"file": f"file://{tmp_path}/store", "memory": f"memory:///{uuid.uuid4().hex}",
              "s3": f"s3://{request.getfixturevalue('bucket') if kind == 's3' else ''}/r"}[kind]
    objstore.put(f"{prefix}/eight", _file(tmp_path, b"abcdefgh"))
    objstore.put(f"{prefix}/empty", _file(tmp_path, b"", "empty"))
    url = f"{prefix}/eight"
    assert objstore.read_range(url, 0, 3) == b"abc"
    assert objstore.read_range(url, 2, 3) == b"cde"
    assert objstore.read_range(url, 6, 10) == b"gh"  # fewer at its end
    assert objstore.read_range(url, 8, 4) == b""  # at its end
    assert objstore.read_range(url, 20, 4) == b""  # past it
    assert objstore.read_range(f"{prefix}/empty", 0, 4096) == b""  # an empty object: what a listing reads first
    said = _raises(lambda: objstore.read_range(f"{prefix}/absent", 0, 4), NotFoundError, 3)
    assert said == f"no such object: {prefix}/absent"


def test_a_folder_url_is_not_an_object() -> None:
    said = _raises(lambda: objstore.fetch("memory:///", 10), UsageError, 2)
    assert said == "'memory:///' names a folder, not a bundle"
    said = _raises(lambda: objstore.read_range("memory:///", 0, 1), UsageError, 2)
    assert said == "'memory:///' names a folder, not a bundle"
    said = _raises(lambda: objstore.put("memory:///", Path(__file__)), UsageError, 2)
    assert said == "'memory:///' names a folder, not an object"


def test_a_stream_hands_out_1_mib_at_a_time_and_the_limit_is_checked_first(tmp_path: Path) -> None:
    src = _file(tmp_path, os.urandom(5 * MIB + 123))
    url = f"file://{src}"
    assert [len(chunk) for chunk in objstore.stream(url, 5 * MIB + 123)] == [MIB] * 5 + [123]
    assert objstore.fetch(url, 5 * MIB + 123) == src.read_bytes()
    said = _raises(lambda: next(objstore.stream(url, 5 * MIB + 122)), UsageError, 2)
    assert said == f"{url} is {5 * MIB + 123} bytes, over the {5 * MIB + 122}-byte limit; not read"
    empty = f"file://{_file(tmp_path, b'', 'empty')}"
    assert objstore.fetch(empty, 0) == b""
    said = _raises(lambda: objstore.fetch(empty, -1), UsageError, 2)
    assert said == "limit_bytes must be at least 0, not -1"


def test_an_object_longer_than_its_store_said_is_cut_off_at_the_limit(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    # The store says 10 bytes and sends 3 MiB: the reader gets the first MiB (within the 1.5 MiB limit), then the
    # refusal, never the second MiB.
    bucket = next(serving := _serve(monkeypatch, _understating))
    try:
        url = f"s3://{bucket}/grown"
        objstore.put(url, _file(tmp_path, os.urandom(3 * MIB)))
        chunks = objstore.stream(url, 3 * MIB // 2)
        assert len(next(chunks)) >= MIB
        assert _raises(lambda: next(chunks), UsageError, 2) == f"{url} is over the {3 * MIB // 2}-byte limit; not read"
    finally:
        serving.close()


def test_a_store_failing_mid_read_is_one_line_after_what_was_read(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    bucket = next(serving := _serve(monkeypatch, _cutting))
    try:
        url = f"s3://{bucket}/cut"
        objstore.put(url, _file(tmp_path, os.urandom(3 * MIB)))
        chunks = objstore.stream(url, 3 * MIB)
        assert len(next(chunks)) >= MIB
        said = _raises(lambda: list(chunks), UnavailableError, 4)
        assert said.startswith(f"{url}: the store is unreachable or failed (") and "body error" in said
    finally:
        serving.close()


def test_a_detail_is_one_line_of_at_most_300_characters() -> None:
    assert objstore._first_line(ValueError("a\n  b\tc ")) == "a b c"
    assert objstore._first_line(ValueError("x" * 300)) == "x" * 300
    assert objstore._first_line(ValueError("x" * 301)) == "x" * 300 + "…"


def test_refused_credentials_are_exit_5_on_every_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bucket = next(serving := _serve(monkeypatch, _denying))
    try:
        url = f"s3://{bucket}/denied.tar.gz"
        for call in (lambda: objstore.put(url, _file(tmp_path, b"abc")), lambda: objstore.fetch(url, 10),
                     lambda: objstore.read_range(url, 0, 10)):
            said = _raises(call, PermissionDeniedError, 5)
            assert said.startswith(f"{url}: the store refused the credentials (")
            assert "403 Forbidden" in said and said.endswith("); see deploy/README.md")
    finally:
        serving.close()


@pytest.mark.parametrize("allow", ["TRUE", "yes", "1"])
def test_http_is_allowed_when_the_environment_says_so(allow: str, bucket: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ALLOW_HTTP", allow)
    objstore.put(f"s3://{bucket}/k", _file(tmp_path, b"abc"))
    assert objstore.fetch(f"s3://{bucket}/k", 3) == b"abc"


@pytest.mark.parametrize("allow", ["false", None])
def test_http_is_refused_otherwise_in_one_line_of_at_most_300_characters_of_detail(
        allow: str | None, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if allow is None:
        monkeypatch.delenv("AWS_ALLOW_HTTP")
    else:
        monkeypatch.setenv("AWS_ALLOW_HTTP", allow)
    url = f"s3://{bucket}/k"
    said = _raises(lambda: objstore.put(url, _file(tmp_path, b"abc")), UnavailableError, 4)
    head, tail = f"{url}: the store is unreachable or failed (", "); check the endpoint and credentials"
    assert said.startswith(head) and said.endswith(tail)
    detail = said[len(head):-len(tail)]
    assert len(detail) == 301 and detail.endswith("…") and "  " not in detail  # obstore's is longer, on lines


def test_the_s3_endpoint_goes_before_the_general_one(bucket: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing answers there
    objstore.put(f"s3://{bucket}/k", _file(tmp_path, b"abc"))
    assert objstore.fetch(f"s3://{bucket}/k", 3) == b"abc"


@pytest.mark.parametrize(("budget_s", "takes_s", "within_s"), [(0.0, 0.5, 1.3), (1.0, 1.0, 2.5)])
def test_a_budget_bounds_a_put_the_store_never_answers(budget_s: float, takes_s: float, within_s: float,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One request of the budget (never under 0.5 s), and no retry after it: the retries share the same budget
    # (three tries would take 3 s and more).
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{hole.getsockname()[1]}"}.items():
            monkeypatch.setenv(key, value)
        src = _file(tmp_path, b"abc")
        failed: list[BaseException] = []

        def put() -> None:
            try:
                objstore.put("s3://bundles/k", src, budget_s=budget_s)
            except BaseException as exc:
                failed.append(exc)

        start = time.monotonic()
        thread = threading.Thread(target=put, daemon=True)
        thread.start()
        thread.join(within_s + 1.0)  # bounded: a put without the budget would take 30 s
        took = time.monotonic() - start
        assert not thread.is_alive(), "the put outlived its budget"
        assert takes_s - 0.05 <= took < within_s
        assert len(failed) == 1 and isinstance(failed[0], UnavailableError) and "unreachable" in str(failed[0])


def test_put_creates_the_folders_it_needs_and_says_why_it_cannot(tmp_path: Path) -> None:
    src = _file(tmp_path, b"abc")
    objstore.put(f"file://{tmp_path}/a/b/c/k.tar.gz", src)
    assert (tmp_path / "a/b/c/k.tar.gz").read_bytes() == b"abc"
    said = _raises(lambda: objstore.put(f"file://{src}/sub/k", src), UnavailableError, 4)
    assert said == f"cannot use {src}/sub: Not a directory"
    said = _raises(lambda: objstore.put(f"file://{tmp_path}/k", tmp_path / "absent"), NotFoundError, 3)
    assert said == f"no such file to upload: {tmp_path}/absent (No such file or directory)"
    if Path("/sys/kernel").is_dir():  # sysfs: no user, root included, makes folders there
        said = _raises(lambda: objstore.put("file:///sys/memwatch-test/k", src), PermissionDeniedError, 5)
        assert said == "cannot write /sys/memwatch-test: permission denied"


def test_reading_from_a_missing_folder_is_not_found_and_creates_nothing(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/none/k.tar.gz"
    assert _raises(lambda: objstore.fetch(url, 10), NotFoundError, 3) == f"no such object: {url}"
    assert _raises(lambda: objstore.read_range(url, 0, 10), NotFoundError, 3) == f"no such object: {url}"
    assert not (tmp_path / "none").exists()


def test_a_bad_key_is_a_usage_error() -> None:
    said = _raises(lambda: objstore.fetch("memory:///a/../b", 10), UsageError, 2)
    assert said == ('memory:///a/../b: Could not parse path: Error parsing Path "a/../b": Encountered illegal '
                    'character sequence ".." whilst parsing path segment ".."')


def test_without_obstore_every_call_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)  # what `import obstore` meets when it is not installed
    for call in (objstore.require, objstore.memory_store, lambda: objstore.list_names(str(tmp_path)),
                 lambda: objstore.put(f"{tmp_path}/k", Path(__file__))):
        assert _raises(call, UnavailableError, 4) == objstore.INSTALL_HINT
    said = objstore._translate(ValueError("from a store"), "s3://b/k")  # obstore gone since the call began
    assert (type(said), str(said)) == (UnavailableError, objstore.INSTALL_HINT)


def test_the_memory_store_is_one_for_the_process() -> None:
    assert objstore.memory_store() is objstore.memory_store()
    key = f"memory:///{uuid.uuid4().hex}/k"
    with open(__file__, "rb") as file:
        objstore.put_file(key, file, Path(__file__).stat().st_size)
    assert objstore.fetch(key, 1 << 20) == Path(__file__).read_bytes()


@pytest.mark.parametrize(("budget_s", "retry_timeout"), [(None, "20s"), (1.0, "1s")])
def test_a_refused_connection_is_retried_twice_within_the_retry_timeout(budget_s: float | None, retry_timeout: str,
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # obstore's own default is 10 retries within 180 s; its error line says which were in force.
    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}.items():
        monkeypatch.setenv(key, value)
    said = _raises(lambda: objstore.put("s3://bundles/k", _file(tmp_path, b"abc"), budget_s=budget_s),
                   UnavailableError, 4)
    assert f", after 2 retries, max_retries: 2, retry_timeout: {retry_timeout} - " in said


def test_a_key_that_begins_with_x_keeps_its_first_letters() -> None:
    # Only the slashes after the bucket are the URL's; the key is the rest, whatever letters it starts with.
    assert objstore.parse("s3://bucket/Xdir/b.tar.gz") == Location("s3", "s3://bucket", "Xdir/b.tar.gz")
    assert objstore.parse("s3://bucket//XX/b.tar.gz").key == "XX/b.tar.gz"


def test_an_upload_onto_a_folder_of_the_same_name_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    # The name is taken by something the store cannot read as an object: it is neither overwritten nor written
    # into, and the refusal is the store's own "no such object" for the name (exit 3), not "unreachable".
    (tmp_path / "b.tar.gz").mkdir()
    url = f"file://{tmp_path}/b.tar.gz"
    with pytest.raises(NotFoundError) as refused:
        objstore.put_file(url, io.BytesIO(b"abc"), 3)
    assert str(refused.value) == f"no such object: {url}" and refused.value.exit_code == 3
    assert os.listdir(tmp_path / "b.tar.gz") == []
