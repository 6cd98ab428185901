"""An incident bundle's manifest, in process: the bytes memwatch writes, and every way a hostile one is refused
with its one line (a bundle comes from a bucket anyone with the key can write)."""

from __future__ import annotations

import json
import re

import pytest

from memwatch.incident import manifest as m
from memwatch.incident.manifest import BundleError, Manifest, check_sizes, digest, parse_manifest, verify

SHA = "a" * 64


def _manifest(**fields: object) -> Manifest:
    files = {name: (SHA, 10) for name in sorted(m.REQUIRED - {m.MANIFEST})}
    made = {"run_id": "run-1", "created_ns": 1_700_000_000_000_000_000, "trigger": "crashed", "verdict": "oom",
            "identity": {"k8s_pod": "vllm-0"}, "files": files, **fields}
    return Manifest(**made)  # type: ignore[arg-type]


def _raw(**changes: object) -> dict:
    raw = json.loads(_manifest().encode())
    raw.update(changes)
    return raw


def _parse(raw: object) -> Manifest:
    return parse_manifest(json.dumps(raw).encode())


def test_the_manifest_is_written_as_sorted_json_one_space_deep() -> None:
    made = _manifest(window={"full_from_ns": 5, "full_seconds_dropped": 2}, dropped=("sidecar.log",),
                     files={"run.db": (SHA, 7)})
    assert made.encode() == (
        '{\n "created_ns": 1700000000000000000,\n "dropped": [\n  "sidecar.log"\n ],\n "files": {\n  "run.db": '
        f'{{\n   "bytes": 7,\n   "sha256": "{SHA}"\n  }}\n }},\n "k8s_pod": "vllm-0",\n "run_id": "run-1",\n'
        ' "schema_version": 1,\n "trigger": "crashed",\n "verdict": "oom",\n "window": {\n  "full_from_ns": 5,\n'
        '  "full_seconds_dropped": 2\n }\n}'
    ).encode()
    assert b'"run_id": "\\u00e9"' in _manifest(run_id="é").encode()  # escaped: the manifest is ASCII


def test_what_is_written_is_read_back_whole() -> None:
    written = _manifest(window={"full_from_ns": 5, "full_seconds_dropped": None}, dropped=("snapshot.json",),
                        identity={**dict.fromkeys(m.IDENTITY_KEYS), "k8s_pod": "vllm-0", "model": "qwen"})
    read = parse_manifest(written.encode())
    assert read == written
    assert read.to_dict()["k8s_pod"] == "vllm-0" and read.identity["hostname"] is None


@pytest.mark.parametrize(("raw", "said"), [
    (b"\xff", "manifest.json is not JSON"),
    (b"{not json", "manifest.json is not JSON"),
    (b"[" * 100_000, "manifest.json is not JSON"),  # nesting past the parser's depth
    (b"[]", "is not a JSON object"),
    (b" " * (m.MAX_MANIFEST_BYTES + 1), f"over {m.MAX_MANIFEST_BYTES:,} bytes"),
])
def test_a_manifest_that_is_not_a_json_object_is_refused(raw: bytes, said: str) -> None:
    with pytest.raises(BundleError, match=re.escape(said)):
        parse_manifest(raw)


def test_a_manifest_at_its_size_bound_is_read() -> None:
    data = _manifest().encode()
    padded = data + b" " * (m.MAX_MANIFEST_BYTES - len(data))
    assert len(padded) == m.MAX_MANIFEST_BYTES and parse_manifest(padded).run_id == "run-1"


@pytest.mark.parametrize(("changes", "said"), [
    ({"schema_version": 2}, "manifest schema 2, this memwatch reads 1; upgrade memwatch"),
    ({"schema_version": None}, "bad 'schema_version' (not a non-negative integer)"),
    ({"schema_version": True}, "bad 'schema_version'"),
    ({"files": []}, "no 'files' object"),
    ({"files": {"evil.sh": {"sha256": SHA, "bytes": 1}}}, "unexpected file 'evil.sh'"),
    ({"files": {"manifest.json": {"sha256": SHA, "bytes": 1}}}, "unexpected file 'manifest.json'"),
    ({"files": {"run.db": "x"}}, "unexpected file 'run.db'"),
    ({"files": {"run.db": {"sha256": "A" * 64, "bytes": 1}}}, "bad checksum for run.db"),
    ({"files": {"run.db": {"sha256": SHA + "0", "bytes": 1}}}, "bad checksum for run.db"),
    ({"files": {"run.db": {"sha256": 5, "bytes": 1}}}, "bad checksum for run.db"),
    ({"files": {"run.db": {"sha256": SHA, "bytes": -1}}}, "bad 'files.run.db.bytes'"),
    ({"files": {"run.db": {"sha256": SHA, "bytes": 2**63}}}, "bad 'files.run.db.bytes'"),
    ({"files": {"run.db": {"sha256": SHA, "bytes": 1}}}, "lacks events.jsonl, explain.json, flags.json, ledger.json"),
    ({"window": []}, "bad 'window' or 'dropped'"),
    ({"dropped": {}}, "bad 'window' or 'dropped'"),
    ({"dropped": ["x"] * 17}, "bad 'window' or 'dropped'"),
    ({"dropped": [5]}, "bad 'dropped'"),
    ({"window": {"full_from_ns": "soon"}}, "bad 'window.full_from_ns'"),
    ({"run_id": None}, "bad 'run_id' (not a string of at most 1024 characters)"),
    ({"run_id": "r" * 1025}, "bad 'run_id'"),
    ({"trigger": 5}, "bad 'trigger'"),
    ({"verdict": None}, "bad 'verdict'"),
    ({"created_ns": "now"}, "bad 'created_ns'"),
    ({"k8s_pod": ["vllm-0"]}, "bad 'k8s_pod'"),
])
def test_each_bad_field_is_named(changes: dict, said: str) -> None:
    with pytest.raises(BundleError, match=re.escape(said)):
        _parse(_raw(**changes))


def test_the_bounds_are_inclusive() -> None:
    """A string of exactly 1,024 characters, 16 dropped names, a size of 2⁶³ − 1: each is read."""
    read = _parse(_raw(run_id="r" * 1024, dropped=["x"] * 16, window={"full_from_ns": 2**63 - 1}))
    assert (len(read.run_id), len(read.dropped), read.window["full_from_ns"]) == (1024, 16, 2**63 - 1)
    assert read.window == {"full_from_ns": 2**63 - 1, "full_seconds_dropped": None}
    assert _parse({k: v for k, v in _raw().items() if k not in ("window", "dropped")}).dropped == ()


def test_declared_sizes_are_bounded_per_member_and_in_all() -> None:
    check_sizes(_manifest(files={"run.db": (SHA, m.MAX_DATABASE_BYTES), "sidecar.log": (SHA, m.MAX_LOG_BYTES)}))
    said = f"declares run.db at {m.MAX_DATABASE_BYTES + 1:,} bytes, over the {m.MAX_DATABASE_BYTES:,} memwatch writes"
    with pytest.raises(BundleError, match=re.escape(said + " as run.db; refusing it")):
        check_sizes(_manifest(files={"run.db": (SHA, m.MAX_DATABASE_BYTES + 1)}))
    said = f"declares events.jsonl at {m.MAX_UNPACKED_BYTES + 1:,} bytes, over the {m.MAX_UNPACKED_BYTES:,} a bundle"
    with pytest.raises(BundleError, match=re.escape(said + " is read to in all")):
        check_sizes(_manifest(files={"events.jsonl": (SHA, m.MAX_UNPACKED_BYTES + 1)}))
    half = m.MAX_UNPACKED_BYTES // 2
    check_sizes(_manifest(files={"events.jsonl": (SHA, half), "flags.json": (SHA, m.MAX_UNPACKED_BYTES - half)}))
    with pytest.raises(BundleError, match=re.escape(f"declares {m.MAX_UNPACKED_BYTES + 1:,} bytes in all")):
        check_sizes(_manifest(files={"events.jsonl": (SHA, half), "flags.json": (SHA, half + 1)}))


def test_every_member_must_match_the_manifest_no_more_and_no_fewer() -> None:
    files = {"run.db": digest(b"db"), "events.jsonl": digest(b"")}
    made = _manifest(files=files)
    # FIPS 180-2's example: SHA-256 of "abc", and the size beside it
    assert digest(b"abc") == ("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", 3)
    verify(made, dict(files))
    with pytest.raises(BundleError, match=re.escape("lacks events.jsonl, which its manifest lists")):
        verify(made, {"run.db": files["run.db"]})
    with pytest.raises(BundleError, match=re.escape("holds flags.json, which its manifest does not list; it was")):
        verify(made, {**files, "flags.json": digest(b"[]")})
    with pytest.raises(BundleError, match=re.escape("the bundle's run.db does not match its manifest's SHA-256")):
        verify(made, {**files, "run.db": digest(b"dB")})
    with pytest.raises(BundleError, match=re.escape("events.jsonl does not match")):
        verify(made, {**files, "events.jsonl": (files["events.jsonl"][0], 1)})  # same digest, another size


DAMAGED = "it is damaged or not a memwatch bundle"


@pytest.mark.parametrize(("raw", "said"), [
    (b"{not json", f"the bundle's manifest.json is not JSON; the bundle is {DAMAGED[6:]}"),
    (b"[]", "the bundle's manifest.json is not a JSON object; not a memwatch bundle"),
])
def test_a_manifest_that_is_no_object_is_refused_in_these_words(raw: bytes, said: str) -> None:
    with pytest.raises(BundleError) as refused:
        parse_manifest(raw)
    assert str(refused.value) == said


@pytest.mark.parametrize(("changes", "said"), [
    ({"files": []}, "the bundle's manifest has no 'files' object; not a memwatch bundle"),
    ({"files": {"x" * 100: {}}}, f"the bundle's manifest names an unexpected file {'x' * 80!r}; not a memwatch bundle"),
    ({"window": []}, "the bundle's manifest has a bad 'window' or 'dropped'; it is damaged"),
    ({"run_id": 5}, f"the bundle's manifest has a bad 'run_id' (not a string of at most 1024 characters); {DAMAGED}"),
    ({"created_ns": -1}, f"the bundle's manifest has a bad 'created_ns' (not a non-negative integer); {DAMAGED}"),
])
def test_each_refusal_is_one_whole_line(changes: dict, said: str) -> None:
    with pytest.raises(BundleError) as refused:
        _parse(_raw(**changes))
    assert str(refused.value) == said


@pytest.mark.parametrize("changes", [{"run_id": None}, {"trigger": None}, {"verdict": None}, {"dropped": [None]},
                                     {"created_ns": None}])
def test_a_required_field_may_not_be_null(changes: dict) -> None:
    with pytest.raises(BundleError, match="has a bad"):
        _parse(_raw(**changes))


def test_zeros_and_empty_strings_are_read_as_they_are() -> None:
    files = {name: {"sha256": SHA, "bytes": 0} for name in sorted(m.REQUIRED - {m.MANIFEST})}
    read = _parse(_raw(created_ns=0, run_id="", trigger="", verdict="", dropped=[""], files=files))
    assert (read.created_ns, read.run_id, read.trigger, read.verdict, read.dropped) == (0, "", "", "", ("",))
    assert set(read.files.values()) == {(SHA, 0)}


def test_a_size_or_checksum_refusal_is_one_whole_line() -> None:
    half = m.MAX_UNPACKED_BYTES // 2
    with pytest.raises(BundleError) as refused:
        check_sizes(_manifest(files={"events.jsonl": (SHA, half), "flags.json": (SHA, half + 1)}))
    assert str(refused.value) == (f"the bundle's manifest declares {m.MAX_UNPACKED_BYTES + 1:,} bytes in all, over the "
                                  f"{m.MAX_UNPACKED_BYTES:,} a bundle is read to; refusing it")
    made = _manifest(files={"run.db": digest(b"db")})
    with pytest.raises(BundleError) as refused:
        verify(made, {"run.db": digest(b"dB")})
    assert str(refused.value) == ("the bundle's run.db does not match its manifest's SHA-256: it was changed after it "
                                  "was built (damaged or tampered with); refusing to read it")
