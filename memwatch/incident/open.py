"""Opening a bundle (a file or a URL) as a read-only database, for every command that reads one.

A bundle is input from elsewhere, so nothing in it is trusted before it is checked, and it is read as a stream
(one chunk at a time, never the whole file in memory):

* size: at most :data:`MAX_BUNDLE_BYTES` read (compressed), at most ``manifest.MAX_UNPACKED_BYTES`` decompressed in
  all, at most :data:`MAX_MEMBERS` members;
* order and type: ``manifest.json`` first, then the others in the order memwatch writes them
  (:data:`~memwatch.incident.manifest.MEMBERS`): only regular files whose names are exactly those (no links,
  devices, folders, paths or repeats);
* declared sizes: the manifest is type-checked (:func:`~memwatch.incident.manifest.parse_manifest`) and its sizes
  bounded (:func:`~memwatch.incident.manifest.check_sizes`) before any other member is read; each member's tar
  header must say the size the manifest declares, and exactly that many bytes are read, so none is decompressed
  past its declared size; ``events.jsonl`` must also be within what its ``run.db`` could have produced
  (:func:`~memwatch.incident.bundle_db.events_bound`);
* integrity: each member's SHA-256 equal to the manifest's as soon as it is read, every listed member present;
* ``run.db``: memwatch's own schema, nothing else (:mod:`memwatch.incident.bundle_db`).

The JSON members are hashed as they stream by and never kept; ``run.db`` is held in SQLite's memory, never written
to a file, so reading a bundle needs no writable folder. Reading stops after ``bundle_db.READ_SECONDS``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from ..errors import NotFoundError, PermissionDeniedError, UsageError
from . import bundle_db
from . import manifest as m
from .manifest import BundleError
from .refs import is_bundle_ref

__all__ = ["OpenedBundle", "is_bundle_ref", "load", "open_bundle", "open_source", "scan"]

MAX_BUNDLE_BYTES = 256 * 1024 * 1024
"""The largest bundle read: four times the default cap, for bundles built with a larger one."""
MAX_MEMBERS = len(m.MEMBERS)
CHUNK = 1 << 20
HEADERS_BYTES = 64 * 1024
"""Room for the tar headers of the members besides their declared bytes."""
Inspect = Callable[[bytearray, float], dict[str, int]]
"""Checks ``run.db`` (its bytes, the deadline): the bounds it sets on the members after it."""


def open_source(ref: str) -> BinaryIO:
    """The compressed bytes of a bundle file or URL as a stream that refuses to give more than
    :data:`MAX_BUNDLE_BYTES` (a longer bundle is refused, not cut)."""
    scheme = ref.split("://", 1)[0].lower() if "://" in ref else ""
    if scheme in ("", "file"):
        path = unquote(urlsplit(ref).path) if scheme else ref
        return _Capped(_open_local(path), ref)
    from .objstore import stream  # obstore, the optional extra: exit 4 with how to install it

    return _Capped(_Chunks(stream(ref, MAX_BUNDLE_BYTES)), ref)


def _open_local(path: str) -> BinaryIO:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFoundError(f"no bundle at {path}; check the path, or list bundles with `memwatch incidents`") \
            from None
    except PermissionError:
        raise PermissionDeniedError(f"cannot read the bundle {path}: no read permission") from None
    except OSError as exc:
        raise UsageError(f"cannot read the bundle {path}: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UsageError(f"the bundle {path} is not a regular file; pass a memwatch-incident-*.tar.gz file")
    if info.st_size > MAX_BUNDLE_BYTES:  # said before reading; a file that grows is stopped by _Capped
        os.close(fd)
        raise BundleError(f"the bundle {path} is over {MAX_BUNDLE_BYTES:,} bytes; not a memwatch bundle")
    return os.fdopen(fd, "rb", buffering=0)


class _Chunks(io.RawIOBase):
    """An iterator of byte chunks (an object store's stream) as a readable file."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._pending = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        while not self._pending:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._pending = chunk
        count = min(len(buffer), len(self._pending))
        buffer[:count], self._pending = self._pending[:count], self._pending[count:]
        return count


class _Capped(io.RawIOBase):
    """A compressed stream of at most :data:`MAX_BUNDLE_BYTES` (read when it is used, so a test may lower it)."""

    def __init__(self, source: BinaryIO | io.RawIOBase, ref: str) -> None:
        self._source, self._ref, self._left = source, ref, MAX_BUNDLE_BYTES

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        count = self._source.readinto(buffer)  # type: ignore[attr-defined]
        self._left -= count or 0
        if self._left < 0:
            raise BundleError(f"the bundle {self._ref} is over {MAX_BUNDLE_BYTES:,} bytes; not a memwatch bundle")
        return count or 0

    def close(self) -> None:
        self._source.close()
        super().close()


class _Bounded(io.RawIOBase):
    """A gzip stream that refuses to decompress more than ``limit`` bytes in all (a gzip bomb stops here)."""

    def __init__(self, source: bytes | BinaryIO | io.RawIOBase, limit: int) -> None:
        raw = io.BytesIO(source) if isinstance(source, bytes | bytearray) else source
        self._gzip = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[arg-type]
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


def scan(source: bytes | BinaryIO | io.RawIOBase, *, keep: bool = True, inspect: Inspect | None = None,
         limit: int | None = None, deadline: float | None = None, ref: str = "") -> tuple[m.Manifest, dict[str, bytes]]:
    """The checked manifest of a bundle, every rule of the module's docstring applied, and (with ``keep``) its other
    members by name. ``inspect`` checks ``run.db`` (default: :func:`memwatch.incident.bundle_db.inspect`, which
    keeps nothing); at most ``limit`` bytes decompressed (default: ``manifest.MAX_UNPACKED_BYTES`` and the headers)."""
    deadline = time.monotonic() + bundle_db.READ_SECONDS if deadline is None else deadline
    inspect = inspect or bundle_db.inspect
    limit = m.MAX_UNPACKED_BYTES + HEADERS_BYTES if limit is None else limit
    kept: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=_Bounded(source, limit), mode="r|", bufsize=CHUNK) as tar:
            manifest = _read_all(tar, keep, kept, inspect, deadline, ref)
    except BundleError:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error, ValueError) as exc:
        raise BundleError(f"the bundle is not a readable tar.gz ({' '.join(str(exc).split())[:120]}); it is damaged "
                          "or not a memwatch bundle") from None
    return manifest, kept


def _read_all(tar: tarfile.TarFile, keep: bool, kept: dict[str, bytes], inspect: Inspect, deadline: float,
              ref: str) -> m.Manifest:
    manifest: m.Manifest | None = None
    bounds: dict[str, int] = {}
    seen: set[str] = set()
    last = -1
    for count, info in enumerate(tar, start=1):
        if count > MAX_MEMBERS:
            raise BundleError(f"the bundle has over {MAX_MEMBERS} members; not a memwatch bundle")
        name = info.name
        if name not in m.MEMBERS:
            raise BundleError(f"the bundle holds an unexpected member {name[:80]!r}; not a memwatch bundle "
                              "(nothing was extracted)")
        if not info.isreg():
            raise BundleError(f"the bundle's {name} is not a regular file (a link or device); refusing it")
        if m.MEMBERS.index(name) <= last:
            raise BundleError(f"the bundle holds {name} out of memwatch's order (or twice); not a memwatch bundle")
        last = m.MEMBERS.index(name)
        seen.add(name)
        if manifest is None:
            if name != m.MANIFEST:
                raise BundleError(f"the bundle starts with {name}, not manifest.json; not a memwatch bundle")
            if info.size > m.MAX_MANIFEST_BYTES:
                raise BundleError(f"the bundle's manifest.json is {info.size:,} bytes, over its limit; refusing it")
            manifest = m.parse_manifest(_read(tar, info, None, deadline)[1])
            m.check_sizes(manifest)
            continue
        _check_declared(manifest, info, bounds)
        sink = bytearray(info.size) if name == m.DATABASE or keep else None
        digest, data = _read(tar, info, sink, deadline)
        if (digest, info.size) != manifest.files[name]:
            raise BundleError(f"the bundle's {name} does not match its manifest's SHA-256: it was changed after it "
                              "was built (damaged or tampered with); refusing to read it")
        if keep:
            kept[name] = bytes(data)
        if name == m.DATABASE:
            try:
                bounds = inspect(data, deadline)
            except BundleError as exc:
                raise BundleError(f"the bundle {ref + ' ' if ref else ''}is not readable: {exc}") from None
    if manifest is None:
        raise BundleError("the bundle has no manifest.json; not a memwatch bundle")
    missing = sorted(set(manifest.files) - seen)
    if missing:
        raise BundleError(f"the bundle lacks {missing[0]}, which its manifest lists; it is damaged or was tampered "
                          "with")
    return manifest


def _check_declared(manifest: m.Manifest, info: tarfile.TarInfo, bounds: dict[str, int]) -> None:
    """The member is listed, its header says the size the manifest declares, and it is within its bound."""
    name = info.name
    if name not in manifest.files:
        raise BundleError(f"the bundle holds {name}, which its manifest does not list; it was tampered with")
    declared = manifest.files[name][1]
    if info.size != declared:
        raise BundleError(f"the bundle's {name} is {info.size:,} bytes where its manifest says {declared:,}; it is "
                          "damaged or was tampered with")
    if info.size > bounds.get(name, info.size):
        raise BundleError(f"the bundle's {name} is {info.size:,} bytes, more than memwatch writes for its run.db "
                          f"(at most {bounds[name]:,}); refusing it")


def _read(tar: tarfile.TarFile, info: tarfile.TarInfo, sink: bytearray | None,
          deadline: float) -> tuple[str, bytearray]:
    """A member's ``info.size`` bytes, hashed as they stream by, into ``sink`` (``None``: a new buffer only for the
    manifest, else nothing kept); its SHA-256 and the buffer."""
    source = tar.extractfile(info)
    digest = hashlib.sha256()
    buffer = sink if sink is not None else bytearray(info.size) if info.name == m.MANIFEST else None
    done = 0
    while done < info.size and source is not None:
        chunk = source.read(min(info.size - done, CHUNK))
        if not chunk:
            break
        digest.update(chunk)
        if buffer is not None:
            buffer[done:done + len(chunk)] = chunk
        done += len(chunk)
        if time.monotonic() > deadline:
            raise BundleError(f"the bundle took over {bundle_db.READ_SECONDS:.0f} s to read; refusing it")
    if done < info.size:
        raise BundleError(f"the bundle's {info.name} is cut short; the bundle is damaged")
    return digest.hexdigest(), buffer if buffer is not None else bytearray()


def load(data: bytes) -> tuple[m.Manifest, dict[str, bytes]]:
    """The checked manifest and the members (``run.db`` included) of a bundle's bytes: :class:`BundleError` unless
    every check passes."""
    return scan(data)


@dataclass
class OpenedBundle:
    """A checked bundle whose database every reading command opens at :attr:`db_path` until :meth:`close`."""

    ref: str
    manifest: m.Manifest
    held: bundle_db.HeldDatabase

    @property
    def db_path(self) -> Path:
        """No file: the name the store opens the bundle's database, in memory, by."""
        return Path(self.held.name)

    def close(self) -> None:
        self.held.close()


def open_bundle(ref: str) -> OpenedBundle:
    """Fetch, check and load the bundle ``ref``: its database, read-only, in memory."""
    deadline = time.monotonic() + bundle_db.READ_SECONDS
    held: list[bundle_db.HeldDatabase] = []

    def inspect(data: bytearray, until: float) -> dict[str, int]:
        database, bounds = bundle_db.load(data, until)
        held.append(database)
        return bounds

    source = open_source(ref)
    try:
        manifest, _ = scan(source, keep=False, inspect=inspect, deadline=deadline, ref=ref)
    except BaseException:
        for database in held:
            database.close()
        raise
    finally:
        source.close()
    return OpenedBundle(ref, manifest, held[0])
