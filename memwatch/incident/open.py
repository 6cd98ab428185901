"""Opening a bundle (a file or a URL) as a read-only database, for every command that reads one.

A bundle is input from elsewhere, so nothing in it is trusted before it is checked:

* size: at most :data:`MAX_BUNDLE_BYTES` read (compressed), at most :data:`MAX_UNPACKED_BYTES` decompressed in all,
  at most :data:`MAX_MEMBERS` members, each under its own limit;
* type: only regular-file members whose names are exactly the fixed names of
  :data:`~memwatch.incident.manifest.MEMBERS` (no links, devices, folders, paths or repeats), read into memory;
  the manifest type-checked (:func:`~memwatch.incident.manifest.parse_manifest`);
* integrity: each member's SHA-256 and size equal to the manifest's, every listed member present.

Only then is ``run.db`` written, under its fixed name, into a private temporary folder (mode 0700, then made
read-only) that is removed when the command ends; no member name is ever used as a path.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import stat
import tarfile
import tempfile
import weakref
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from ..errors import NotFoundError, PermissionDeniedError, UsageError
from . import manifest as m
from .manifest import BundleError
from .refs import is_bundle_ref

__all__ = ["OpenedBundle", "fetch", "is_bundle_ref", "load", "open_bundle", "read_members"]

MAX_BUNDLE_BYTES = 256 * 1024 * 1024
"""The largest bundle read: four times the default cap, for bundles built with a larger one."""
MAX_UNPACKED_BYTES = 2 * 1024 * 1024 * 1024
"""Decompressed bytes in all (tar headers included): a 64 MiB bundle of SQLite pages unpacks to a few hundred MiB."""
MAX_MEMBERS = len(m.MEMBERS)
CHUNK = 1 << 20
MEMBER_LIMITS = {m.MANIFEST: m.MAX_MANIFEST_BYTES, m.LOG: 16 * 1024 * 1024}
"""Per member; the others share :data:`MAX_UNPACKED_BYTES`."""
def fetch(ref: str, limit: int = MAX_BUNDLE_BYTES) -> bytes:
    """The bytes of a bundle file or URL, at most ``limit`` (a longer one is refused, not cut)."""
    scheme = ref.split("://", 1)[0].lower() if "://" in ref else ""
    if scheme in ("", "file"):
        path = unquote(urlsplit(ref).path) if scheme else ref
        data = _read_local(path, limit)
    else:
        from .objstore import fetch as fetch_object  # obstore, the optional extra: exit 4 with how to install it

        data = fetch_object(ref, limit)
    if len(data) > limit:
        raise BundleError(f"the bundle {ref} is over {limit:,} bytes; not a memwatch bundle")
    return data


def _read_local(path: str, limit: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFoundError(f"no bundle at {path}; check the path, or list bundles with `memwatch incidents`") \
            from None
    except PermissionError:
        raise PermissionDeniedError(f"cannot read the bundle {path}: no read permission") from None
    except OSError as exc:
        raise UsageError(f"cannot read the bundle {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"the bundle {path} is not a regular file; pass a memwatch-incident-*.tar.gz file")
        return f.read(limit + 1)


class _Bounded(io.RawIOBase):
    """A gzip stream that refuses to decompress more than ``limit`` bytes in all (a gzip bomb stops here)."""

    def __init__(self, data: bytes, limit: int) -> None:
        self._gzip = gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb")
        self._left = self._limit = limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = min(len(buffer), self._left + 1)
        chunk = self._gzip.read(want)
        if len(chunk) > self._left:
            raise BundleError(f"the bundle unpacks to over {self._limit:,} bytes; not a memwatch bundle")
        self._left -= len(chunk)
        buffer[:len(chunk)] = chunk
        return len(chunk)


def read_members(data: bytes, limit: int | None = None, *,
                 database: BinaryIO | None = None) -> tuple[dict[str, bytes], dict[str, tuple[str, int]]]:
    """The members of a bundle's bytes by name and each one's SHA-256 and size, every rule of the module's docstring
    applied; at most ``limit`` bytes decompressed (default :data:`MAX_UNPACKED_BYTES`). With ``database``, ``run.db``
    is copied there as it is read (hashed on the way) instead of being kept in memory."""
    limit = MAX_UNPACKED_BYTES if limit is None else limit
    members: dict[str, bytes] = {}
    digests: dict[str, tuple[str, int]] = {}
    try:
        with tarfile.open(fileobj=_Bounded(data, limit), mode="r|") as tar:
            for count, info in enumerate(tar, start=1):
                if count > MAX_MEMBERS:
                    raise BundleError(f"the bundle has over {MAX_MEMBERS} members; not a memwatch bundle")
                name = info.name
                if name not in m.MEMBERS or name in digests:
                    raise BundleError(f"the bundle holds an unexpected member {name[:80]!r}; not a memwatch bundle "
                                      "(nothing was extracted)")
                if not info.isreg():
                    raise BundleError(f"the bundle's {name} is not a regular file (a link or device); refusing it")
                if info.size > MEMBER_LIMITS.get(name, limit):
                    raise BundleError(f"the bundle's {name} is {info.size:,} bytes, over its limit; refusing it")
                source = tar.extractfile(info)
                sink = database if name == m.DATABASE and database is not None else io.BytesIO()
                digests[name] = _copy(source, sink, info.size, name)
                if isinstance(sink, io.BytesIO):
                    members[name] = sink.getvalue()
    except BundleError:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error, ValueError) as exc:
        raise BundleError(f"the bundle is not a readable tar.gz ({' '.join(str(exc).split())[:120]}); it is damaged "
                          "or not a memwatch bundle") from None
    if m.MANIFEST not in members:
        raise BundleError("the bundle has no manifest.json; not a memwatch bundle")
    return members, digests


def _copy(source: BinaryIO | None, sink: BinaryIO, size: int, name: str) -> tuple[str, int]:
    """Copy a member's ``size`` bytes to ``sink`` in chunks; its SHA-256 and size."""
    digest = hashlib.sha256()
    left = size
    while left > 0 and source is not None:
        chunk = source.read(min(left, CHUNK))
        if not chunk:
            break
        digest.update(chunk)
        sink.write(chunk)
        left -= len(chunk)
    if left:
        raise BundleError(f"the bundle's {name} is cut short; the bundle is damaged")
    return digest.hexdigest(), size


def load(data: bytes, *, database: BinaryIO | None = None) -> tuple[m.Manifest, dict[str, bytes]]:
    """The checked manifest and the members of a bundle (:class:`BundleError` unless every check passes); with
    ``database``, ``run.db`` is written there rather than returned."""
    members, digests = read_members(data, database=database)
    manifest = m.parse_manifest(members.pop(m.MANIFEST))
    digests.pop(m.MANIFEST)
    m.verify(manifest, digests)
    return manifest, members


@dataclass
class OpenedBundle:
    """A checked bundle whose database lies, read-only, at :attr:`db_path` until :meth:`close`."""

    ref: str
    manifest: m.Manifest
    db_path: Path
    _folder: Path
    _finalizer: weakref.finalize = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _remove, self._folder)

    def close(self) -> None:
        self._finalizer()


def _remove(folder: Path) -> None:
    try:
        os.chmod(folder, 0o700)
    except OSError:
        pass
    shutil.rmtree(folder, ignore_errors=True)


def open_bundle(ref: str) -> OpenedBundle:
    """Fetch, check and unpack the bundle ``ref``; its database, read-only, in a private temporary folder."""
    data = fetch(ref)
    folder = Path(tempfile.mkdtemp(prefix="memwatch-bundle-"))
    try:
        path = folder / m.DATABASE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
        with os.fdopen(fd, "wb") as f:
            manifest, _ = load(data, database=f)
        os.chmod(folder, 0o500)  # read-only: SQLite opens the file immutable, with no -shm or journal beside it
        _check_database(ref, path)
    except BaseException:
        _remove(folder)
        raise
    return OpenedBundle(ref, manifest, path, folder)


def _check_database(ref: str, path: Path) -> None:
    """``run.db`` is a memwatch database this memwatch reads (a forger can rewrite the checksums too): said of the
    bundle, not of the temporary file a command would otherwise name."""
    import sqlite3

    from ..errors import StoreError
    from ..store.db import open_store

    try:
        open_store(path, readonly=True).conn.close()
    except StoreError as exc:
        why = str(exc).replace(str(path), "its run.db").split("; pass another --db")[0]
        raise BundleError(f"the bundle {ref} is not readable: {why}") from None
    except sqlite3.DatabaseError as exc:
        raise BundleError(f"the bundle {ref} holds no readable database ({exc})") from None


@dataclass(frozen=True)
class Listed:
    """One bundle under a prefix: its manifest when it verified, else why it was refused."""

    uri: str
    manifest: m.Manifest | None
    error: str | None = None

    def to_dict(self) -> dict[str, object]:
        made = self.manifest
        return {"uri": self.uri, "verified": made is not None, "error": self.error,
                "created_ns": None if made is None else made.created_ns,
                "run_id": None if made is None else made.run_id,
                "pod": None if made is None else made.identity.get("k8s_pod") or made.identity.get("hostname"),
                "model": None if made is None else made.identity.get("model"),
                "verdict": None if made is None else made.verdict,
                "trigger": None if made is None else made.trigger}


BUNDLE_PREFIX = "memwatch-incident-"
MAX_LISTED = 100
"""The most bundles one listing verifies by default, the newest by name (each is fetched whole to check it)."""


def list_names(prefix: str) -> list[str]:
    """The bundle URLs (or paths) directly under ``prefix``: a folder, a ``file://`` URL or an object-store prefix."""
    scheme = prefix.split("://", 1)[0].lower() if "://" in prefix else ""
    if scheme in ("", "file"):
        folder = unquote(urlsplit(prefix).path) if scheme else prefix
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            raise NotFoundError(f"no folder {folder}; pass the folder or URL bundles are written to") from None
        except NotADirectoryError:
            raise UsageError(f"{folder} is not a folder; pass the folder bundles are written to") from None
        except PermissionError:
            raise PermissionDeniedError(f"cannot list {folder}: no permission") from None
        base = prefix.rstrip("/") + "/"
        return [base + name for name in names if name.startswith(BUNDLE_PREFIX) and name.endswith(".tar.gz")]
    from .objstore import list_names as list_objects

    return [name for name in list_objects(prefix) if name.rsplit("/", 1)[-1].startswith(BUNDLE_PREFIX)
            and name.endswith(".tar.gz")]


def list_bundles(prefix: str, limit: int = MAX_LISTED) -> list[Listed]:
    """Every bundle under ``prefix``, each fetched and verified, newest first (refused ones last, by name)."""
    listed = []
    for uri in list_names(prefix)[-limit:]:
        try:
            listed.append(Listed(uri, load(fetch(uri))[0]))
        except BundleError as exc:
            listed.append(Listed(uri, None, str(exc)))
    return sorted(listed, key=lambda item: (item.manifest is None, -(item.manifest.created_ns if item.manifest
                                                                      else 0), item.uri))
