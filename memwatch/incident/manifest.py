"""An incident bundle's ``manifest.json``: its schema, the checksums of its other files, and their checking.

A bundle comes from elsewhere (another node, a bucket anyone with the key can write), so its manifest is input:
it is parsed only after its size is bounded, every field is type-checked before use, and every other member must
match the SHA-256 and size the manifest names, no more and no fewer files. Any mismatch is :class:`BundleError`
(exit 6), one line.

The sizes the manifest declares are bounded before any other member is read (:func:`check_sizes`), by what
memwatch itself writes (:mod:`memwatch.incident.bundle`):

* ``manifest.json``: :data:`MAX_MANIFEST_BYTES`; a manifest names a handful of files and a few identity strings;
* ``sidecar.log``: :data:`MAX_LOG_BYTES`, the tail the build keeps (``bundle.LOG_TAIL_BYTES``, 2,000 lines at most);
* ``run.db``: :data:`MAX_DATABASE_BYTES`, the most a reader holds in memory (it is loaded into SQLite's memory,
  twice while it is loaded): a default-capped bundle (64 MiB, compressed about 3.2 to 1 by the build's gzip) holds
  about 200 MiB; a bigger one is refused (unpack it with ``tar`` and pass its ``run.db`` as ``--db``);
* all members together: :data:`MAX_UNPACKED_BYTES`, which bounds the time spent decompressing and hashing.

``events.jsonl`` is bounded further by the ``run.db`` it comes with (see :mod:`memwatch.incident.bundle_db`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import StoreError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
DATABASE = "run.db"
LEDGER = "ledger.json"
FLAGS = "flags.json"
EXPLAIN = "explain.json"
EVENTS = "events.jsonl"
SNAPSHOT = "snapshot.json"
LOG = "sidecar.log"
MEMBERS = (MANIFEST, DATABASE, LEDGER, FLAGS, EXPLAIN, EVENTS, SNAPSHOT, LOG)
"""Every name a bundle may hold, in the order they are written; ``run.db`` and the JSON files are required."""
REQUIRED = frozenset({MANIFEST, DATABASE, LEDGER, FLAGS, EXPLAIN, EVENTS})

MAX_MANIFEST_BYTES = 256 * 1024
"""A manifest names a handful of files and a few identity strings: a few KiB."""
MAX_LOG_BYTES = 256 * 1024
"""The log tail a bundle may hold: ``bundle.LOG_TAIL_BYTES``, the most the build keeps."""
MAX_DATABASE_BYTES = 192 * 1024 * 1024
"""The largest ``run.db`` read: held in memory, twice while it is loaded, under a reader's 512 MiB."""
MAX_UNPACKED_BYTES = 1024 * 1024 * 1024
"""Every member together, decompressed: hashing them takes a few seconds, not minutes."""
LIMITS = {MANIFEST: MAX_MANIFEST_BYTES, DATABASE: MAX_DATABASE_BYTES, LOG: MAX_LOG_BYTES}
"""Each member's own bound; the JSON members share :data:`MAX_UNPACKED_BYTES` (``events.jsonl`` is bounded by its
``run.db`` too)."""
MAX_TEXT = 1024
"""The longest identity string kept (a pod name is at most 253 characters)."""

IDENTITY_KEYS = ("engine", "engine_version", "model", "hostname", "k8s_namespace", "k8s_pod", "k8s_container",
                 "k8s_node", "container_id", "gpu_name", "gpu_uuid", "driver_version")
"""Where and on what the run ran: each a string or null."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


class BundleError(StoreError):
    """A bundle that is damaged, tampered with, too large or not a memwatch bundle (exit 6)."""


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says, checked."""

    run_id: str
    created_ns: int
    trigger: str
    verdict: str
    identity: dict[str, str | None]
    files: dict[str, tuple[str, int]]
    """Member name → (SHA-256 hex, size in bytes), for every member but the manifest."""
    window: dict[str, int | None] = field(default_factory=dict)
    """``full_from_ns``: the first full-resolution sample kept; ``full_seconds_dropped``: seconds rolled up."""
    dropped: tuple[str, ...] = ()
    """What was left out to fit the size cap, in the order it was dropped."""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "run_id": self.run_id, "created_ns": self.created_ns,
                "trigger": self.trigger, "verdict": self.verdict, **self.identity, "window": self.window,
                "dropped": list(self.dropped),
                "files": {name: {"sha256": digest, "bytes": size} for name, (digest, size) in self.files.items()}}

    def encode(self) -> bytes:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True).encode("utf-8")


def digest(data: bytes) -> tuple[str, int]:
    return hashlib.sha256(data).hexdigest(), len(data)


def _text(value: Any, key: str, *, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise BundleError(f"the bundle's manifest has a bad {key!r} (not a string of at most {MAX_TEXT} characters); "
                          "it is damaged or not a memwatch bundle")
    return value


def _int(value: Any, key: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise BundleError(f"the bundle's manifest has a bad {key!r} (not a non-negative integer); it is damaged or "
                          "not a memwatch bundle")
    return value


def parse_manifest(data: bytes) -> Manifest:
    """The manifest in ``data``, every field type-checked; anything else is :class:`BundleError`."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise BundleError(f"the bundle's manifest is over {MAX_MANIFEST_BYTES:,} bytes; not a memwatch bundle")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BundleError("the bundle's manifest.json is not JSON; the bundle is damaged or not a memwatch "
                          "bundle") from None
    if not isinstance(raw, dict):
        raise BundleError("the bundle's manifest.json is not a JSON object; not a memwatch bundle")
    version = _int(raw.get("schema_version"), "schema_version")
    if version != SCHEMA_VERSION:
        raise BundleError(f"the bundle has manifest schema {version}, this memwatch reads {SCHEMA_VERSION}; "
                          "upgrade memwatch")
    files = raw.get("files")
    if not isinstance(files, dict):
        raise BundleError("the bundle's manifest has no 'files' object; not a memwatch bundle")
    checked: dict[str, tuple[str, int]] = {}
    for name, entry in files.items():
        if name not in MEMBERS or name == MANIFEST or not isinstance(entry, dict):
            raise BundleError(f"the bundle's manifest names an unexpected file {name[:80]!r}; not a memwatch bundle")
        sha = entry.get("sha256")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise BundleError(f"the bundle's manifest has a bad checksum for {name}; it is damaged")
        checked[name] = (sha, _int(entry.get("bytes"), f"files.{name}.bytes") or 0)
    missing = REQUIRED - {MANIFEST} - set(checked)
    if missing:
        raise BundleError(f"the bundle's manifest lacks {', '.join(sorted(missing))}; not a memwatch bundle")
    window = raw.get("window", {})
    dropped = raw.get("dropped", [])
    if not isinstance(window, dict) or not isinstance(dropped, list) or len(dropped) > 16:
        raise BundleError("the bundle's manifest has a bad 'window' or 'dropped'; it is damaged")
    return Manifest(
        run_id=_text(raw.get("run_id"), "run_id", optional=False) or "",
        created_ns=_int(raw.get("created_ns"), "created_ns") or 0,
        trigger=_text(raw.get("trigger"), "trigger", optional=False) or "",
        verdict=_text(raw.get("verdict"), "verdict", optional=False) or "",
        identity={key: _text(raw.get(key), key) for key in IDENTITY_KEYS},
        files=checked,
        window={key: _int(window.get(key), f"window.{key}", optional=True)
                for key in ("full_from_ns", "full_seconds_dropped")},
        dropped=tuple(_text(item, "dropped", optional=False) or "" for item in dropped),
        schema_version=version,
    )


def check_sizes(manifest: Manifest) -> None:
    """Every size the manifest declares is within its member's bound and all together within
    :data:`MAX_UNPACKED_BYTES`: else :class:`BundleError`, before anything else of the bundle is read."""
    for name, (_, size) in manifest.files.items():
        limit = LIMITS.get(name, MAX_UNPACKED_BYTES)
        if size > limit:
            bound = f"the {limit:,} memwatch writes as {name}" if name in LIMITS else \
                f"the {limit:,} a bundle is read to in all"
            raise BundleError(f"the bundle's manifest declares {name} at {size:,} bytes, over {bound}; refusing it")
    total = sum(size for _, size in manifest.files.values())
    if total > MAX_UNPACKED_BYTES:
        raise BundleError(f"the bundle's manifest declares {total:,} bytes in all, over the {MAX_UNPACKED_BYTES:,} "
                          "a bundle is read to; refusing it")


def verify(manifest: Manifest, members: Mapping[str, tuple[str, int]]) -> None:
    """Every member (name → its own SHA-256 and size) is one the manifest names, with the same checksum, and none
    the manifest names is missing: else :class:`BundleError` naming the first file that differs."""
    for name in sorted(set(manifest.files) | set(members)):
        if name not in members:
            raise BundleError(f"the bundle lacks {name}, which its manifest lists; it is damaged or was tampered with")
        if name not in manifest.files:
            raise BundleError(f"the bundle holds {name}, which its manifest does not list; it was tampered with")
        if members[name] != manifest.files[name]:
            raise BundleError(f"the bundle's {name} does not match its manifest's SHA-256: it was changed after it "
                              "was built (damaged or tampered with); refusing to read it")
