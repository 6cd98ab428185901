"""Forged incident bundles for the reading tests: a real bundle's members, changed, with a manifest that matches.

A forger who can write the bucket can rewrite the manifest too, so every bundle made here passes the checksum
check: what refuses it must be the check of what the members are.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
import tarfile
import time
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

from memwatch.incident import manifest as m
from memwatch.incident.bundle import build_bundle
from memwatch.store import open_store

from stored_runs import store_scenario


def real_members(root: Path, scenario: str = "clean_chat") -> tuple[str, dict[str, bytes]]:
    """A real bundle of a stored scenario: its run id and its members by name (the manifest included). The database
    it was built from stays at ``root / "memwatch.db"``."""
    runtime = root / "run"
    runtime.mkdir(mode=0o700)
    run_id = store_scenario(scenario, runtime, root / "memwatch.db")
    db = open_store(root / "memwatch.db", readonly=True)
    path = build_bundle(db, run_id, "manual", root / "out")
    db.conn.close()
    with tarfile.open(path) as tar:
        members = {info.name: tar.extractfile(info).read() for info in tar}  # type: ignore[union-attr]
    return run_id, members


def incompressible_members(root: Path) -> dict[str, bytes]:
    """A real bundle's members with 256 KiB of log that does not compress: a bundle of about 250 KB."""
    _, found = real_members(root)
    log = base64.b64encode(os.urandom(192 * 1024))  # 256 KiB, the most a bundle holds
    return reseal({**found, m.LOG: log})


def reseal(members: Mapping[str, bytes]) -> dict[str, bytes]:
    """The members with a manifest whose checksums and sizes are those of the members as they now are."""
    raw = json.loads(members[m.MANIFEST])
    raw["files"] = {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                    for name, data in members.items() if name != m.MANIFEST}
    return {**members, m.MANIFEST: json.dumps(raw, indent=1, sort_keys=True).encode()}


def pack(members: Mapping[str, bytes]) -> bytes:
    """The members as a tar.gz, in the order memwatch writes them."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name in m.MEMBERS:
            if name in members:
                info = tarfile.TarInfo(name)
                info.size = len(members[name])
                tar.addfile(info, io.BytesIO(members[name]))
    return out.getvalue()


def changed_database(database: bytes, statements: Iterable[str], tmp_path: Path) -> bytes:
    """``run.db`` after ``statements`` (a forger's own SQL, run on a copy)."""
    path = tmp_path / f"forged-{hashlib.sha256(database).hexdigest()[:8]}-{id(statements)}.db"
    path.write_bytes(database)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in statements:
            conn.execute(statement)
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()
    data = path.read_bytes()
    path.unlink()
    return data


def forged(members: Mapping[str, bytes], statements: Iterable[str], tmp_path: Path) -> bytes:
    """A whole bundle whose ``run.db`` had ``statements`` run on it, resealed."""
    database = changed_database(members[m.DATABASE], statements, tmp_path)
    return pack(reseal({**members, m.DATABASE: database}))


def bomb(members: Mapping[str, bytes], events_bytes: int) -> bytes:
    """A bundle whose ``events.jsonl`` is ``events_bytes`` of newlines (blank lines: JSON Lines' nothing), compressed
    about 1,000 to 1: its checksum is right, so only a size bound stops it. Each MiB of newlines compresses alone
    (a full flush between them) to the same bytes, so the bundle is made by repeating them, not by compressing."""
    chunk = b"\n" * (1 << 20)
    whole, rest = divmod(events_bytes, len(chunk))
    digest = hashlib.sha256()
    for _ in range(whole):
        digest.update(chunk)
    digest.update(chunk[:rest])
    raw = json.loads(members[m.MANIFEST])
    files = {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
             for name, data in members.items() if name != m.MANIFEST}
    files[m.EVENTS] = {"sha256": digest.hexdigest(), "bytes": events_bytes}
    raw["files"] = files
    head = {**members, m.MANIFEST: json.dumps(raw, indent=1, sort_keys=True).encode()}
    after = [name for name in m.MEMBERS[m.MEMBERS.index(m.EVENTS) + 1:] if name in head]
    tail = bytes(-events_bytes % tarfile.BLOCKSIZE) + b"".join(
        _header(name, len(head[name])) + head[name] + bytes(-len(head[name]) % tarfile.BLOCKSIZE) for name in after)
    tail += bytes(2 * tarfile.BLOCKSIZE)  # the end of the archive
    prefix = _tar_prefix(head, m.EVENTS, events_bytes)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    start = deflate.compress(prefix) + deflate.flush(zlib.Z_FULL_FLUSH)
    repeated = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    end = deflate.compress(chunk[:rest]) + deflate.compress(tail) + deflate.flush()
    crc = zlib.crc32(prefix)
    for _ in range(whole):
        crc = zlib.crc32(chunk, crc)
    crc = zlib.crc32(tail, zlib.crc32(chunk[:rest], crc))
    size = len(prefix) + events_bytes + len(tail)
    trailer = crc.to_bytes(4, "little") + (size % 2**32).to_bytes(4, "little")
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + start + repeated * whole + end + trailer


def _tar_prefix(members: Mapping[str, bytes], upto: str, size: int) -> bytes:
    """The uncompressed tar of the members before ``upto``, then ``upto``'s header for ``size`` bytes."""
    out = []
    for name in m.MEMBERS[:m.MEMBERS.index(upto)]:
        if name in members:
            data = members[name]
            out += [_header(name, len(data)), data, bytes(-len(data) % tarfile.BLOCKSIZE)]
    out.append(_header(upto, size))
    return b"".join(out)


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(tarfile.PAX_FORMAT)


_MEASURE = ("import os, subprocess, sys\n"
            "child = subprocess.Popen(sys.argv[1:], close_fds=False)\n"
            "_, status, usage = os.wait4(child.pid, 0)\n"
            "print(f'maxrss-kib={usage.ru_maxrss}')\n"
            "sys.exit(os.waitstatus_to_exitcode(status))\n")


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def run_memwatch(*args: str, timeout: float = 30.0, env: dict[str, str] | None = None, cwd: str | None = None,
                 prefix: tuple[str, ...] = (), pass_fds: tuple[int, ...] = ()) -> tuple[int, str, float, float]:
    """``memwatch ARGS`` in a child with at most 1 GiB of address space, killed (with what it started) at
    ``timeout``: its exit code (-9 when killed), output, seconds and peak resident MiB (from ``wait4``)."""
    started = time.monotonic()
    child = subprocess.Popen([*prefix, sys.executable, "-c", _MEASURE, sys.executable, "-m", "memwatch", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_limit_memory, env=env,
                             cwd=cwd, start_new_session=True, pass_fds=pass_fds)
    try:
        out, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, _ = child.communicate(timeout=10)
        return -9, out.decode(errors="replace"), time.monotonic() - started, 0.0
    text = out.decode(errors="replace")
    body, _, rss = text.rstrip("\n").rpartition("maxrss-kib=")
    return child.returncode, body, time.monotonic() - started, int(rss or 0) / 1024
