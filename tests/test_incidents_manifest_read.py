"""Reading a bundle's manifest from its first bytes: bounded reads, and every refusal word for word.

A listing reads each bundle only up to its manifest (the tar's first member): one read of 64 KiB, a second only
when the manifest runs past it, never more than ``MAX_READ_BYTES``. What is not a gzip-framed tar beginning with
a manifest within its bound is refused with one line naming why.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import tarfile
import zlib
from collections.abc import Callable

import pytest
from bundle_forge import incompressible_members, pack, reseal

from memwatch.incident import manifest as m
from memwatch.incident.listing import MAX_READ_BYTES, read_manifest
from memwatch.incident.manifest import BundleError


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return incompressible_members(tmp_path_factory.mktemp("manifest-read"))


def test_the_manifest_read_is_bounded_whatever_the_file(members: dict[str, bytes]) -> None:
    asked: list[tuple[int, int]] = []
    data = pack(members)

    def read(start: int, length: int) -> bytes:
        asked.append((start, length))
        return data[start:start + length]

    assert read_manifest(read).run_id == json.loads(members[m.MANIFEST])["run_id"]
    assert asked == [(0, 64 * 1024)]
    # A manifest at its bound that does not compress: two reads, never more than MAX_READ_BYTES in all.
    raw = json.loads(members[m.MANIFEST])
    raw["padding"] = base64.b64encode(os.urandom(180_000)).decode()
    data = pack(reseal({**members, m.MANIFEST: json.dumps(raw).encode()}))
    asked.clear()
    assert read_manifest(read).run_id == raw["run_id"]
    assert len(asked) == 2 and sum(length for _, length in asked) == MAX_READ_BYTES


def test_a_manifest_member_over_its_bound_or_cut_short_is_refused(members: dict[str, bytes]) -> None:
    def reader(data: bytes) -> Callable[[int, int], bytes]:
        return lambda start, length: data[start:start + length]

    with pytest.raises(m.BundleError, match="an empty tar; not a memwatch bundle"):
        read_manifest(reader(pack({})))
    huge = b"{" + b" " * m.MAX_MANIFEST_BYTES + b"}"
    with pytest.raises(m.BundleError, match=f"its manifest.json is {len(huge):,} bytes, over its limit"):
        read_manifest(reader(pack({m.MANIFEST: huge})))
    cut = pack({m.MANIFEST: base64.b64encode(os.urandom(90_000))})
    with pytest.raises(m.BundleError, match=r"not a readable tar\.gz \(unexpected end of data\); it is damaged"):
        read_manifest(reader(cut[:len(cut) // 2]))
    assert read_manifest(reader(pack(members))).run_id == json.loads(members[m.MANIFEST])["run_id"]


def _tar(entries: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    """An uncompressed tar (PAX) of ``entries``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _refusal(data: bytes) -> str:
    with pytest.raises(BundleError) as refused:
        read_manifest(lambda start, length: data[start:start + length])
    return str(refused.value)


def test_a_manifest_at_its_bound_is_read_and_one_byte_more_or_headers_past_their_room_are_refused(
        members: dict[str, bytes]) -> None:
    # Padded with spaces (JSON allows them; they compress to nothing): one read each.
    raw = members[m.MANIFEST]
    at_bound = raw + b" " * (m.MAX_MANIFEST_BYTES - len(raw))
    assert read_manifest(lambda start, length: pack({m.MANIFEST: at_bound})[start:start + length]).run_id == \
        json.loads(raw)["run_id"]
    over = f"its manifest.json is {m.MAX_MANIFEST_BYTES + 1:,} bytes, over its limit; refusing it"
    assert _refusal(pack({m.MANIFEST: at_bound + b" "})) == over
    # 20 KiB of pax header before it, past the 16 KiB room: decompression stops at the bound, within the manifest.
    info = tarfile.TarInfo(m.MANIFEST)
    info.pax_headers = {"comment": "x" * 20 * 1024}
    assert _refusal(gzip.compress(_tar([(info, at_bound)]))) == ("not a readable tar.gz (unexpected end of data); it "
                                                                 "is damaged or not a memwatch bundle")


def test_what_is_not_a_gzip_framed_tar_beginning_with_the_manifest_is_refused_word_for_word(
        members: dict[str, bytes]) -> None:
    manifest = tarfile.TarInfo(m.MANIFEST)
    plain = _tar([(manifest, members[m.MANIFEST])])
    assert _refusal(zlib.compress(plain)) == ("not a readable tar.gz (Error -3 while decompressing data: incorrect "
                                              "header check); it is damaged or not a memwatch bundle")
    # The inner gzip stream is read as a tar header, so which check it fails depends on its bytes (a real manifest's
    # vary with its run, and gzip writes the time): a fixed member and time, whose inner stream is shorter than
    # one 512-byte tar header.
    inner = gzip.compress(_tar([(tarfile.TarInfo(m.MANIFEST), b"{}")]), mtime=0)
    assert len(inner) < 512
    assert _refusal(gzip.compress(inner, mtime=0)) == (
        "not a readable tar.gz (truncated header); it is damaged or not a memwatch bundle")
    assert _refusal(pack({})) == "an empty tar; not a memwatch bundle"
    long_name = "run-" + "x" * 100 + ".db"
    assert _refusal(gzip.compress(_tar([(tarfile.TarInfo(long_name), b"1")]))) == (
        f"starts with {long_name[:80]!r}, not manifest.json; not a memwatch bundle")


def test_a_damaged_bundle_costs_one_read_and_one_cut_past_the_first_read_two(members: dict[str, bytes]) -> None:
    asked: list[tuple[int, int]] = []

    def reader(data: bytes) -> Callable[[int, int], bytes]:
        asked.clear()
        return lambda start, length: asked.append((start, length)) or data[start:start + length]

    small = gzip.compress(os.urandom(3000))  # a gzip, not a tar: all of it came in the first read
    with pytest.raises(BundleError, match=r"^not a readable tar\.gz \("):
        read_manifest(reader(small))
    assert asked == [(0, 64 * 1024)]
    raw = json.loads(members[m.MANIFEST])
    raw["padding"] = base64.b64encode(os.urandom(150_000)).decode()
    cut = pack({m.MANIFEST: json.dumps(raw).encode()})[:100_000]  # the manifest's first 100 KB of about 200
    with pytest.raises(BundleError) as refused:
        read_manifest(reader(cut))
    assert str(refused.value) == ("not a readable tar.gz (unexpected end of data); it is damaged or not a memwatch "
                                  "bundle")
    assert asked == [(0, 64 * 1024), (64 * 1024, MAX_READ_BYTES - 64 * 1024)]
