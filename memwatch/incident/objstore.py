"""Read, list and write incident bundles wherever they live: a folder, S3, GCS, Azure, or memory.

One small door onto obstore (``pip install memwatch[bundles]``), imported only when a URL is used, so the
base install and every command that never names a URL stay as they are. URLs:

- a plain path or ``file:///dir/name``: a local folder (created on write);
- ``s3://bucket/key``, ``gs://bucket/key``, ``az://container/key``: credentials and endpoint come from the
  cloud SDKs' standard environment (``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_*``) or the
  node's workload identity; ``AWS_ENDPOINT_URL`` (with ``AWS_ALLOW_HTTP=true``) points at any S3 API;
- ``memory:///key``: one in-memory store shared by the process (tests and demos).

Every call is bounded in time (connect and request timeouts, a bounded number of retries) and a fetch is
bounded in size before anything is read. Every failure is one :mod:`memwatch.errors` line: obstore
missing or the store unreachable is exit 4, refused credentials exit 5, no such object exit 3, a bad URL
or an object over the limit exit 2.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

from memwatch.errors import (
    MemwatchError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
    UsageError,
)

INSTALL_HINT = "install memwatch[bundles] (pip install 'memwatch[bundles]') to read or write bundles by URL"
CLOUD_SCHEMES = ("s3", "gs", "az")
SCHEMES = ("file", "memory", *CLOUD_SCHEMES)

# One request may take this long; connecting, this long; obstore retries a failed request at most this
# many times within RETRY_TIMEOUT. Together they bound one call to roughly CONNECT + RETRY_TIMEOUT.
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 30.0
MAX_RETRIES = 2
RETRY_TIMEOUT_S = 20.0

_memory_lock = threading.Lock()
_memory_store: Any = None


@dataclass(frozen=True)
class Location:
    """Where one URL points: the store's root URL, the key below it, and the URL as users read it."""

    scheme: str
    root: str
    key: str

    def url(self, key: str | None = None) -> str:
        """The user-facing URL of ``key`` (default: this location's own key) in the same store."""
        key = self.key if key is None else key
        if self.scheme == "file":
            return "file://" + str(Path(self.root) / key) if key else "file://" + self.root
        if self.scheme == "memory":
            return "memory:///" + key
        return f"{self.root}/{key}" if key else self.root


def parse(url: str) -> Location:
    """Split a bundle URL into its store and key; a plain path is a local file (the default scheme).

    A local location keeps its whole path as ``root`` and an empty key: whether it is a folder or a file is
    decided by the call that uses it.
    """
    if not isinstance(url, str) or not url or "\x00" in url:
        raise UsageError(f"not a bundle URL: {url!r}")
    if "://" not in url:
        return Location("file", str(Path(url).expanduser().absolute()), "")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise UsageError(f"unsupported URL scheme {scheme!r} in {url!r}: use a path, file://, s3://, gs:// or az://")
    if parts.query or parts.fragment:
        raise UsageError(f"a bundle URL takes no query or fragment: {url!r}")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UsageError(f"a file:// URL names no host: {url!r} (use file:///absolute/path)")
        return Location("file", unquote(parts.path) or "/", "")
    if scheme == "memory":
        return Location("memory", "memory:///", (parts.netloc + parts.path).strip("/"))
    if not parts.netloc:
        raise UsageError(f"{url!r} names no bucket or container (e.g. {scheme}://bucket/incidents/)")
    return Location(scheme, f"{scheme}://{parts.netloc}", parts.path.lstrip("/"))


def _obstore() -> Any:
    """obstore, or one line saying how to get it."""
    try:
        import obstore
    except ImportError:
        raise UnavailableError(INSTALL_HINT) from None
    return obstore


def require() -> None:
    """Raise the one-line :class:`UnavailableError` now when obstore is not installed."""
    _obstore()


def memory_store() -> Any:
    """The process's one in-memory store (what ``memory://`` URLs name)."""
    global _memory_store
    obs = _obstore()
    with _memory_lock:
        if _memory_store is None:
            _memory_store = obs.store.MemoryStore()
        return _memory_store


def _cloud_store(root: str, budget_s: float | None = None) -> Any:
    """A store for a bucket or container, with bounded timeouts and retries (within ``budget_s`` when given)."""
    obs = _obstore()
    budget = max(0.5, budget_s) if budget_s is not None else REQUEST_TIMEOUT_S + RETRY_TIMEOUT_S
    client = {"connect_timeout": timedelta(seconds=min(CONNECT_TIMEOUT_S, budget)),
              "timeout": timedelta(seconds=budget if budget_s is not None else REQUEST_TIMEOUT_S)}
    if os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes"):
        client["allow_http"] = True
    retry = {"max_retries": MAX_RETRIES, "retry_timeout": timedelta(seconds=min(RETRY_TIMEOUT_S, budget)),
             "backoff": {"init_backoff": timedelta(milliseconds=200), "max_backoff": timedelta(seconds=5), "base": 2}}
    kwargs: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if root.startswith("s3://") and endpoint:
        kwargs["endpoint"] = endpoint
    try:
        return obs.store.from_url(root, client_options=client, retry_config=retry, **kwargs)
    except Exception as exc:  # obstore raises its own errors and ValueError for a bad configuration
        raise _translate(exc, root) from None


def _store_for(loc: Location, *, write: bool = False, budget_s: float | None = None) -> tuple[Any, str]:
    """The store and the key within it for a location (a local folder is created to ``write`` in)."""
    if loc.scheme == "memory":
        return memory_store(), loc.key
    if loc.scheme == "file":
        obs = _obstore()
        path = Path(loc.root)
        folder, key = (path.parent, path.name) if loc.key == "" else (path, loc.key)
        if write:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise _os_error(exc, str(folder)) from None
        elif not folder.is_dir():  # obstore would say "unable to canonicalize" (exit 4): it is simply not there
            raise NotFoundError(f"no such object: {loc.url()}")
        try:
            return obs.store.LocalStore(str(folder)), key
        except Exception as exc:
            raise _translate(exc, loc.url()) from None
    return _cloud_store(loc.root, budget_s), loc.key


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("…" if len(text) > 300 else "")


def _os_error(exc: OSError, what: str) -> MemwatchError:
    if isinstance(exc, PermissionError):
        return PermissionDeniedError(f"cannot write {what}: permission denied")
    return UnavailableError(f"cannot use {what}: {exc.strerror or exc}")


def _translate(exc: BaseException, url: str) -> MemwatchError:
    """One memwatch error, with its exit code, for whatever obstore raised."""
    if isinstance(exc, MemwatchError):
        return exc
    try:
        from obstore import exceptions as oe
    except ImportError:  # pragma: no cover - only reached with obstore present
        return UnavailableError(INSTALL_HINT)
    detail = _first_line(exc)
    if isinstance(exc, oe.NotFoundError | FileNotFoundError):
        return NotFoundError(f"no such object: {url}")
    if isinstance(exc, oe.PermissionDeniedError | oe.UnauthenticatedError):
        return PermissionDeniedError(f"{url}: the store refused the credentials ({detail}); see deploy/README.md")
    if isinstance(exc, oe.InvalidPathError | oe.UnknownConfigurationKeyError | ValueError):
        return UsageError(f"{url}: {detail}")
    return UnavailableError(f"{url}: the store is unreachable or failed ({detail}); check the endpoint and credentials")


def fetch(url: str, limit_bytes: int) -> bytes:
    """The whole object at ``url``; refused (exit 2) before reading when it is over ``limit_bytes``."""
    return b"".join(stream(url, limit_bytes))


def stream(url: str, limit_bytes: int) -> Iterator[bytes]:
    """The object at ``url`` in chunks of about 1 MiB, never more than ``limit_bytes`` in all (exit 2 beyond, before
    reading when the store says so up front): a reader holds one chunk at a time, not the object."""
    if limit_bytes < 0:
        raise UsageError(f"limit_bytes must be at least 0, not {limit_bytes}")
    loc = parse(url)
    store, key = _store_for(loc)
    if not key:
        raise UsageError(f"{url!r} names a folder, not a bundle")
    obs = _obstore()
    try:
        result = obs.get(store, key)
        size = int(result.meta["size"])
        if size > limit_bytes:
            raise UsageError(f"{url} is {size} bytes, over the {limit_bytes}-byte limit; not read")
        chunks = iter(result.stream(min_chunk_size=1 << 20))
    except Exception as exc:
        raise _translate(exc, url) from None
    got = 0
    while True:
        try:
            chunk = next(chunks, None)
        except Exception as exc:
            raise _translate(exc, url) from None
        if chunk is None:
            return
        got += len(chunk)
        if got > limit_bytes:  # the object grew after its size was read
            raise UsageError(f"{url} is over the {limit_bytes}-byte limit; not read")
        yield bytes(chunk)


def read_range(url: str, start: int, length: int) -> bytes:
    """At most ``length`` bytes of the object at ``url`` from ``start`` (fewer at its end): one ranged request,
    whatever the object's size."""
    loc = parse(url)
    store, key = _store_for(loc)
    if not key:
        raise UsageError(f"{url!r} names a folder, not a bundle")
    try:
        return bytes(_obstore().get_range(store, key, start=start, length=length))
    except Exception as exc:
        if _RANGE_PAST_END.search(str(exc)):  # a range at or past the end (an empty object): nothing there
            return b""
        raise _translate(exc, url) from None


_RANGE_PAST_END = re.compile(r"\b416 Range Not Satisfiable\b|\bStartTooLarge\b")
"""How a range that starts at or past an object's end is refused: by S3; by a local folder and the memory store."""


MAX_LISTED = 100_000
"""Objects a listing reads at most (their names, a few MB); beyond, the prefix is refused as too wide."""


def list_names(prefix_url: str) -> list[str]:
    """The full URL of every object under ``prefix_url`` (a folder or a bucket prefix), sorted; each can be fetched."""
    loc = parse(prefix_url)
    obs = _obstore()
    if loc.scheme == "file":
        folder = Path(loc.root)
        if not folder.is_dir():
            raise NotFoundError(f"no such folder: {folder}")
        store, prefix = obs.store.LocalStore(str(folder)), None
    else:
        store, prefix = _store_for(loc)
        prefix = prefix.rstrip("/") or None
    names: list[str] = []
    try:
        for batch in obs.list(store, prefix):
            names += [str(m["path"]) for m in batch]
            if len(names) > MAX_LISTED:  # a listing is input from elsewhere too: bounded in memory and time
                raise UsageError(f"more than {MAX_LISTED:,} objects under {prefix_url}; give a narrower prefix "
                                 "(a day's or a pod's)")
    except Exception as exc:
        raise _translate(exc, prefix_url) from None
    return sorted(loc.url(name) for name in names)


def put(url: str, path: Path, *, budget_s: float | None = None) -> None:
    """Upload the file at ``path`` to ``url`` if nothing is there yet (put-if-absent).

    An object already at ``url`` with the same size counts as this upload done before (a retry after a crash
    between upload and clean-up), so uploading twice never makes two copies; one of another size is refused
    (exit 2) and never overwritten. ``budget_s`` shortens the time one call may take (a sidecar's shutdown).
    """
    try:
        with open(path, "rb") as file:
            put_file(url, file, os.fstat(file.fileno()).st_size, budget_s=budget_s)
    except OSError as exc:
        raise NotFoundError(f"no such file to upload: {path} ({exc.strerror})") from None


def put_file(url: str, file: BinaryIO, size: int, *, budget_s: float | None = None) -> None:
    """:func:`put` of an open file of ``size`` bytes (the spool hands its files over by descriptor)."""
    loc = parse(url)
    store, key = _store_for(loc, write=True, budget_s=budget_s)
    if not key:
        raise UsageError(f"{url!r} names a folder, not an object")
    obs = _obstore()
    try:
        obs.put(store, key, file, mode="create", use_multipart=False)
        return
    except Exception as exc:
        from obstore import exceptions as oe

        if not isinstance(exc, oe.AlreadyExistsError | oe.PreconditionError):
            raise _translate(exc, url) from None
    try:
        there = int(obs.head(store, key)["size"])
    except Exception as exc:
        raise _translate(exc, url) from None
    if there != size:
        raise UsageError(f"{url} already holds another object ({there} bytes, not {size}); not overwritten")
