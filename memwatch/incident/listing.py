"""``memwatch incidents``: the bundles under a folder or prefix, each known by its manifest alone.

A bundle's manifest is the tar's first member, so a listing reads only the start of each bundle: one ranged read of
:data:`FIRST_READ_BYTES` (a manifest is a few KiB, compressed), a second up to :data:`MAX_READ_BYTES` only for a
manifest near its 256 KiB bound, and decompresses at most the manifest's bound. Listing 100 bundles is 100 small
reads, whatever their sizes. The manifest is type-checked and its declared sizes bounded
(:func:`~memwatch.incident.manifest.check_sizes`); the members' checksums are checked when a bundle is opened.

Local entries are opened ``O_NOFOLLOW | O_NONBLOCK`` and judged by ``fstat`` of that descriptor: a link, a folder, a
FIFO or a device named like a bundle is refused without being followed, read or waited on. Whatever is wrong with
one entry (that, a damaged file, a hostile manifest) is that entry's ``REFUSED`` line, never the listing's end.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from ..errors import MemwatchError, NotFoundError, PermissionDeniedError, UsageError
from . import manifest as m
from .manifest import BundleError

BUNDLE_PREFIX = "memwatch-incident-"
MAX_LISTED = 100
"""The most bundles one listing reads by default, the newest by name."""
FIRST_READ_BYTES = 64 * 1024
"""The first ranged read of a bundle: its gzip header, the manifest's tar header and the manifest compressed (a few
KiB; JSON compresses to a third or less, so this holds manifests far larger than memwatch writes)."""
MAX_READ_BYTES = m.MAX_MANIFEST_BYTES + 64 * 1024
"""The most read of one bundle: an incompressible manifest at its bound, its headers and gzip's framing."""
HEADER_ROOM = 16 * 1024
"""Decompressed bytes allowed before the manifest's data: its tar header and a pax header."""

Reader = Callable[[int, int], bytes]
"""Reads ``length`` bytes at ``start`` (fewer at the end of the object)."""


@dataclass(frozen=True)
class Listed:
    """One bundle under a prefix: its manifest when it could be read and checked, else why it was refused."""

    uri: str
    manifest: m.Manifest | None
    error: str | None = None

    def to_dict(self) -> dict[str, object]:
        made = self.manifest
        return {"uri": self.uri, "refused": made is None, "error": self.error,
                "created_ns": None if made is None else made.created_ns,
                "run_id": None if made is None else made.run_id,
                "pod": None if made is None else made.identity.get("k8s_pod") or made.identity.get("hostname"),
                "model": None if made is None else made.identity.get("model"),
                "verdict": None if made is None else made.verdict,
                "trigger": None if made is None else made.trigger}


def _local_folder(prefix: str) -> str | None:
    scheme = prefix.partition("://")[0].lower() if "://" in prefix else ""
    if scheme == "":
        return prefix
    return unquote(urlsplit(prefix).path) if scheme == "file" else None


def list_names(prefix: str) -> list[str]:
    """The bundle URLs (or paths) directly under ``prefix``: a folder, a ``file://`` URL or an object-store prefix."""
    folder = _local_folder(prefix)
    if folder is not None:
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            raise NotFoundError(f"no folder {folder}; pass the folder or URL bundles are written to") from None
        except NotADirectoryError:
            raise UsageError(f"{folder} is not a folder; pass the folder bundles are written to") from None
        except PermissionError:
            raise PermissionDeniedError(f"cannot list {folder}: no permission") from None
        except OSError as exc:  # a name too long, a link loop: the path given is the user's to fix
            raise UsageError(f"cannot list {folder}: {exc.strerror or exc}; pass the folder bundles are written "
                             "to") from None
        base = prefix.rstrip("/") + "/"
        return [base + name for name in names if name.startswith(BUNDLE_PREFIX) and name.endswith(".tar.gz")]
    from .objstore import list_names as list_objects

    return [name for name in list_objects(prefix) if name.rpartition("/")[2].startswith(BUNDLE_PREFIX)
            and name.endswith(".tar.gz")]


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _local_manifest(path: str) -> m.Manifest:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BundleError("a symbolic link, not a bundle; not followed") from None
        if exc.errno == errno.ENXIO:  # what opening a socket answers (or a device with no driver)
            raise BundleError("a socket, not a bundle file; not read") from None
        raise BundleError(f"cannot be opened ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise BundleError(f"{_kind(mode)}, not a bundle file; not read")
        return read_manifest(lambda start, length: os.pread(fd, length, start))
    finally:
        os.close(fd)


def _remote_manifest(uri: str) -> m.Manifest:
    from .objstore import read_range

    return read_manifest(lambda start, length: read_range(uri, start, length))


def read_manifest(read: Reader) -> m.Manifest:
    """A bundle's checked manifest from the start of its bytes: one ranged ``read``, two for a large manifest."""
    head = read(0, FIRST_READ_BYTES)
    whole = len(head) < FIRST_READ_BYTES
    found = _manifest_in(head, whole)
    if found is None:
        head += read(len(head), MAX_READ_BYTES - len(head))
        found = _manifest_in(head, True) or b""
    manifest = m.parse_manifest(found)
    m.check_sizes(manifest)
    return manifest


def _manifest_in(head: bytes, whole: bool) -> bytes | None:
    """The manifest's bytes in a bundle's first compressed bytes ``head``; ``None`` when more are needed and
    ``whole`` says there may be more."""
    inflate = zlib.decompressobj(wbits=31)  # gzip's framing
    try:
        data = inflate.decompress(head, m.MAX_MANIFEST_BYTES + HEADER_ROOM)  # a cut stream gives what it has
    except zlib.error as exc:
        raise BundleError(f"not a readable tar.gz ({exc}); it is damaged or not a memwatch bundle") from None
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
            info = tar.next()
            if info is None:
                raise BundleError("an empty tar; not a memwatch bundle")
            if info.name != m.MANIFEST or not info.isreg():
                raise BundleError(f"starts with {info.name[:80]!r}, not manifest.json; not a memwatch bundle")
            if info.size > m.MAX_MANIFEST_BYTES:
                raise BundleError(f"its manifest.json is {info.size:,} bytes, over its limit; refusing it")
            member = tar.extractfile(info)
            assert member is not None  # tarfile gives every regular member a reader
            return member.read()  # a member cut short is tarfile's ReadError
    except (tarfile.TarError, EOFError, OSError) as exc:
        if not whole:
            return None
        raise BundleError(f"not a readable tar.gz ({' '.join(str(exc).split())[:120]}); it is damaged or not a "
                          "memwatch bundle") from None


def list_bundles(prefix: str, limit: int = MAX_LISTED) -> list[Listed]:
    """The newest ``limit`` bundles under ``prefix`` by name, each by its manifest alone; newest first, the refused
    ones last (by name)."""
    listed = []
    for uri in list_names(prefix)[-limit:]:
        path = _local_folder(uri)
        try:
            listed.append(Listed(uri, _local_manifest(path) if path is not None else _remote_manifest(uri)))
        except (MemwatchError, OSError, ValueError) as exc:
            listed.append(Listed(uri, None, " ".join(str(exc).split())[:300]))
    return sorted(listed, key=lambda item: (item.manifest is None, -(item.manifest.created_ns if item.manifest
                                                                      else 0), item.uri))
