"""``memwatch incidents``: each bundle known by its manifest alone, one ranged read apiece, and a bad entry one line.

Over the real S3 API the suite uses (moto on loopback), behind a proxy that counts every byte the store sends and
every request it gets: listing 10 bundles of ~250 KB each is one listing request and 10 reads of their first
64 KiB. In a local folder, a folder, a FIFO, a link, a damaged file and hostile manifests named like bundles are
each one ``REFUSED`` line, and the listing goes on (it used to end at the first: "unexpected IsADirectoryError").
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import threading
import uuid
from pathlib import Path

import pytest
from bundle_forge import incompressible_members, pack, reseal, run_memwatch
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.errors import NotFoundError, PermissionDeniedError, UsageError
from memwatch.incident import manifest as m
from memwatch.incident.listing import Listed, list_bundles, list_names
from memwatch.incident.manifest import BundleError

from ship_s3 import S3Server, free_port


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return incompressible_members(tmp_path_factory.mktemp("listing"))


def _manifest_only(manifest: bytes) -> bytes:
    """A tar.gz holding only a manifest (all a listing reads)."""
    return pack({m.MANIFEST: manifest})


class CountingProxy:
    """A TCP proxy on loopback that keeps what the client sent and counts the bytes the server sent back."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.sent = bytearray()
        self.received = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="counting-proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream), timeout=10)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, upward: bool) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    if upward:
                        self.sent += data
                    else:
                        self.received += len(data)
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            source.close()  # each pump closes the end it reads; the other pump closes the other

    def requests(self) -> list[tuple[str, str, str | None]]:
        """Method, path and ``Range`` header of every request the client sent."""
        text = bytes(self.sent).decode("latin-1")
        found = []
        for head in re.split(r"\r\n\r\n", text):
            first = re.search(r"^(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1\.1", head, re.M)
            if first:
                ranged = re.search(r"^range: (.+)$", head, re.M | re.I)
                found.append((first[1], first[2], ranged[1].strip() if ranged else None))
        return found

    def close(self) -> None:
        self._listener.close()


def test_listing_over_s3_reads_only_each_manifest(members: dict[str, bytes], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    server = S3Server(free_port()).start()
    proxy = CountingProxy(server.port)
    try:
        bucket = f"incidents-{uuid.uuid4().hex[:12]}"
        client = server.client()
        client.create_bucket(Bucket=bucket)
        data = pack(members)
        assert len(data) > 200_000
        for i in range(10):
            client.put_object(Bucket=bucket, Key=f"prod/memwatch-incident-2030010{i}T000000.000Z-pod-x.tar.gz",
                              Body=data)
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        result = CliRunner().invoke(main, ["incidents", f"s3://{bucket}/prod/", "--json"])
        assert result.exit_code == 0, result.output
        requests = proxy.requests()
        reads = [(path, ranged) for method, path, ranged in requests if method == "GET" and "list-type" not in path]
        assert len(requests) == 11 and len(reads) == 10  # one listing, one read a bundle
        assert {ranged for _, ranged in reads} == {"bytes=0-65535"}
        # What came back: 10 times 64 KiB and the headers, and the listing's XML; not 10 times 250 KB.
        assert proxy.received < 10 * (64 * 1024 + 2048) + 16 * 1024, proxy.received
        assert proxy.received < 10 * len(data) // 3
        listed = [json.loads(line) for line in result.stdout.splitlines()]
        assert len(listed) == 10 and not any(item["refused"] for item in listed)
        assert {item["run_id"] for item in listed} == {json.loads(members[m.MANIFEST])["run_id"]}
    finally:
        proxy.close()
        server.stop()


NAME = "memwatch-incident-2030010{}T000000.000Z-{}-x.tar.gz"
REFUSED = {"folder": "a folder, not a bundle file; not read",
           "fifo": "a FIFO, not a bundle file; not read",
           "link": "a symbolic link, not a bundle; not followed",
           "damaged": "not a readable tar.gz",
           "notjson": "the bundle's manifest.json is not JSON",
           "bomb": "the bundle's manifest declares events.jsonl at 1,900,000,000 bytes",
           "first": "starts with 'run.db', not manifest.json"}


def _bad_folder(members: dict[str, bytes], tmp_path: Path) -> Path:
    """Two good bundles (one with a manifest large enough for a second read) among seven bad entries."""
    folder = tmp_path / "incidents"
    folder.mkdir()
    name = NAME
    (folder / name.format(1, "good")).write_bytes(pack(members))
    raw = json.loads(members[m.MANIFEST])
    raw["padding"] = os.urandom(100_000).hex()  # 200 KB that compresses to ~100 KB: a second read
    big = reseal({**members, m.MANIFEST: json.dumps(raw).encode()})
    (folder / name.format(2, "big")).write_bytes(pack(big))
    (folder / name.format(3, "folder")).mkdir()
    os.mkfifo(folder / name.format(4, "fifo"))
    (folder / name.format(5, "link")).symlink_to(folder / name.format(1, "good"))
    (folder / name.format(6, "damaged")).write_bytes(b"\x1f\x8b" + os.urandom(4000))
    (folder / name.format(7, "notjson")).write_bytes(_manifest_only(b"{not json"))
    declared = {**raw, "files": {**raw["files"], m.EVENTS: {"sha256": "0" * 64, "bytes": 1_900_000_000}}}
    (folder / name.format(8, "bomb")).write_bytes(_manifest_only(json.dumps(declared).encode()))
    (folder / name.format(9, "first")).write_bytes(pack({m.DATABASE: members[m.DATABASE]}))
    return folder


def test_every_bad_entry_in_a_folder_is_one_refused_line(members: dict[str, bytes], tmp_path: Path) -> None:
    folder = _bad_folder(members, tmp_path)
    code, out, seconds, rss_mib = run_memwatch("incidents", str(folder), timeout=30)
    lines = out.strip().splitlines()
    assert code == 6 and len(lines) == 11, out  # the header, nine entries, the error
    rows = {line.split()[-1].split("-")[3]: line for line in lines[1:-1]}
    assert "REFUSED" not in rows["good"] + rows["big"]
    for key, said in REFUSED.items():
        assert f"REFUSED: {said}" in rows[key], (key, rows[key])
    assert lines[-1] == (f"error: 7 of 9 entries under {folder} were refused (not a bundle, or its manifest failed "
                         "its checks)")
    assert seconds < 20 and rss_mib < 128, (seconds, rss_mib)


def _key(listed: Listed) -> str:
    return Path(listed.uri).name.split("-")[3]


def test_in_process_each_bad_entry_costs_only_itself_and_the_good_come_first(members: dict[str, bytes],
                                                                              tmp_path: Path) -> None:
    folder = _bad_folder(members, tmp_path)
    listed = list_bundles(str(folder))
    assert [_key(item) for item in listed] == ["good", "big", "folder", "fifo", "link", "damaged", "notjson",
                                               "bomb", "first"]  # same creation: by name; the refused last
    for item in listed[2:]:
        assert item.manifest is None and REFUSED[_key(item)] in (item.error or ""), (_key(item), item.error)
    raw = json.loads(members[m.MANIFEST])
    good = listed[0].to_dict()
    assert good == {"uri": f"{folder}/{NAME.format(1, 'good')}", "refused": False, "error": None,
                    "created_ns": raw["created_ns"], "run_id": raw["run_id"],
                    "pod": raw.get("k8s_pod") or raw["hostname"], "model": raw["model"], "verdict": raw["verdict"],
                    "trigger": raw["trigger"]}
    refused = listed[-1].to_dict()
    assert refused["refused"] is True and refused["error"] == listed[-1].error
    assert all(refused[key] is None for key in ("created_ns", "run_id", "pod", "model", "verdict", "trigger"))


def test_the_newest_by_name_are_listed_up_to_the_limit(members: dict[str, bytes], tmp_path: Path) -> None:
    folder = _bad_folder(members, tmp_path)
    assert [_key(item) for item in list_bundles(str(folder), limit=3)] == ["notjson", "bomb", "first"]
    assert [_key(item) for item in list_bundles(f"file://{folder}/", limit=2)] == ["bomb", "first"]


def test_bundles_are_named_files_under_the_folder_and_nothing_else(members: dict[str, bytes], tmp_path: Path) -> None:
    folder = tmp_path / "a b"
    folder.mkdir()
    for name in ("memwatch-incident-1.tar.gz", "memwatch-incident-2.tar.gz", "memwatch-incident-3.tar",
                 "other.tar.gz", "x-memwatch-incident-4.tar.gz"):
        (folder / name).write_bytes(b"")
    expected = ["memwatch-incident-1.tar.gz", "memwatch-incident-2.tar.gz"]
    assert list_names(str(folder)) == [f"{folder}/{name}" for name in expected]
    assert list_names(f"{folder}//") == [f"{folder}/{name}" for name in expected]
    url = "FILE://" + str(folder).replace(" ", "%20")
    assert list_names(url) == [f"{url}/{name}" for name in expected]
    with pytest.raises(NotFoundError, match=f"no folder {tmp_path}/missing; pass the folder or URL"):
        list_names(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="is not a folder; pass the folder bundles are written to"):
        list_names(str(folder / "other.tar.gz"))


def test_object_store_names_are_filtered_like_a_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = S3Server(free_port()).start()
    try:
        bucket = f"names-{uuid.uuid4().hex[:12]}"
        server.client().create_bucket(Bucket=bucket)
        for key in ("p/memwatch-incident-1.tar.gz", "p/memwatch-incident-2.json", "p/other.tar.gz"):
            server.client().put_object(Bucket=bucket, Key=key, Body=b"")
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        assert list_names(f"s3://{bucket}/p/") == [f"s3://{bucket}/p/memwatch-incident-1.tar.gz"]
        [item] = list_bundles(f"s3://{bucket}/p/")
        assert item.manifest is None and "not a readable tar.gz" in (item.error or "")  # an empty object: S3's 416
    finally:
        server.stop()


def test_each_kind_of_entry_that_is_not_a_file_is_named(members: dict[str, bytes], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole refusal, word for word, for what a folder of bundles may hold besides bundles (a device only by its
    mode: making one needs a privilege the tests do not assume)."""
    from memwatch.incident.listing import _kind, _local_manifest

    folder = _bad_folder(members, tmp_path)
    monkeypatch.chdir(folder)  # a socket's path is bounded (108 bytes): bound by its name in its folder
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(NAME.format(0, "socket"))
        by_key = {_key(item): item.error for item in list_bundles(str(folder))}
    assert by_key["socket"] == "a socket, not a bundle file; not read"
    for key in ("folder", "fifo", "link"):
        assert by_key[key] == REFUSED[key], key
    assert (_kind(stat.S_IFCHR), _kind(stat.S_IFBLK), _kind(stat.S_IFLNK)) == ("a device", "a device",
                                                                                "not a regular file")
    with pytest.raises(BundleError) as refused:
        _local_manifest(str(folder / NAME.format(5, "link")))
    assert str(refused.value) == "a symbolic link, not a bundle; not followed"
    with pytest.raises(BundleError) as refused:
        _local_manifest(str(folder / "gone.tar.gz"))
    assert str(refused.value) == "cannot be opened (No such file or directory)"


def test_a_bundle_is_listed_under_its_pod_else_its_host(members: dict[str, bytes], tmp_path: Path) -> None:
    folder = tmp_path / "incidents"
    folder.mkdir()
    raw = json.loads(members[m.MANIFEST])
    for key, pod in (("pod", "vllm-0"), ("host", None)):
        sealed = reseal({**members, m.MANIFEST: json.dumps({**raw, "k8s_pod": pod, "hostname": "node-7"}).encode()})
        (folder / NAME.format(1 if pod else 2, key)).write_bytes(pack(sealed))
    assert {_key(item): item.to_dict()["pod"] for item in list_bundles(str(folder))} == {"pod": "vllm-0",
                                                                                         "host": "node-7"}


def test_the_newest_by_creation_come_first_whatever_their_names(members: dict[str, bytes], tmp_path: Path) -> None:
    # Names sort the other way round from creation (a pod whose clock ran behind names its bundles earlier).
    folder = tmp_path / "incidents"
    folder.mkdir()
    raw = json.loads(members[m.MANIFEST])
    for i, created in enumerate((3, 1, 2)):
        sealed = reseal({**members, m.MANIFEST: json.dumps({**raw, "created_ns": created * 10**18}).encode()})
        (folder / NAME.format(i, f"c{created}")).write_bytes(pack(sealed))
    (folder / NAME.format(3, "damaged")).write_bytes(b"\x1f\x8b" + os.urandom(100))
    listed = list_bundles(str(folder))
    assert [_key(item) for item in listed] == ["c3", "c2", "c1", "damaged"]
    assert [item.to_dict()["created_ns"] for item in listed] == [3 * 10**18, 2 * 10**18, 10**18, None]


def test_a_refusal_is_cut_to_300_characters(members: dict[str, bytes], tmp_path: Path) -> None:
    # A manifest naming a file of 80 control characters: the refusal quotes the name, each character as four, and
    # is longer than a listing line keeps.
    folder = tmp_path / "incidents"
    folder.mkdir()
    raw = json.loads(members[m.MANIFEST])
    odd = "\x01" * 80
    files = {**raw["files"], odd: {"sha256": "0" * 64, "bytes": 1}}
    (folder / NAME.format(1, "odd")).write_bytes(_manifest_only(json.dumps({**raw, "files": files}).encode()))
    [item] = list_bundles(str(folder))
    said = f"the bundle's manifest names an unexpected file {odd!r}; not a memwatch bundle"
    assert len(said) > 300 and item.error == said[:300]


def test_a_file_url_is_a_folder_even_with_the_scheme_separator_in_its_path(tmp_path: Path) -> None:
    folder = tmp_path / "a:" / "" / "b"  # the folder a:/b, given as a://b
    folder.mkdir(parents=True)
    (folder / "memwatch-incident-1.tar.gz").write_bytes(b"")
    url = f"file://{tmp_path}/a://b"
    assert list_names(url) == [f"{url}/memwatch-incident-1.tar.gz"]
    [item] = list_bundles(url)
    assert item.manifest is None and item.error is not None and item.error.startswith("not a readable tar.gz")


def test_a_folder_that_cannot_be_listed_is_the_users_to_fix(tmp_path: Path) -> None:
    too_long = tmp_path / ("x" * 300)
    with pytest.raises(UsageError) as refused:
        list_names(str(too_long))
    assert str(refused.value) == f"cannot list {too_long}: File name too long; pass the folder bundles are written to"
    folder = tmp_path / "bundlesX"  # a name ending in X, and a slash after it dropped
    folder.mkdir()
    (folder / "memwatch-incident-1.tar.gz").write_bytes(b"")
    assert list_names(f"{folder}/") == [f"{folder}/memwatch-incident-1.tar.gz"]


def test_a_folder_the_user_may_not_read_is_refused_as_no_permission(tmp_path: Path) -> None:
    """Listed by a user other than root (root reads any folder: a child process drops to uid 65534 first)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    assert list_names(str(locked)) == []  # listed while it may be read
    os.chmod(locked, 0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            try:
                list_names(str(locked))
                said = "listed"
            except PermissionDeniedError as exc:
                said = str(exc)
            os.write(write, said.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    assert said == f"cannot list {locked}: no permission"
