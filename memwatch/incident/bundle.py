"""Building an incident bundle: one ``memwatch-incident-<utc>-<pod or host>-<run>.tar.gz`` with a run's evidence.

It holds ``manifest.json`` (:mod:`memwatch.incident.manifest`), ``run.db`` (the run's rows, full resolution and
per-second roll-ups, in a memwatch database every reading command opens), ``ledger.json`` (the shared quantities of
:mod:`memwatch.store.run_figures` and ``check``'s ledger), ``flags.json``, ``explain.json`` (``explain``'s account),
``events.jsonl``, ``snapshot.json`` (the imported memory snapshot's events, when there is one: data, never a pickle)
and ``sidecar.log`` (the log's tail, when the sidecar built it). Requests are stored as token counts and ids only:
there is no request text to leave out.

Over the size cap (64 MiB by default), what goes first: the per-second roll-ups are always kept; the full-resolution
window is shortened (its older seconds are rolled up, as retention does) down to :data:`MIN_WINDOW_NS`; then the
log tail is cut. The manifest says what was dropped. The file appears under its final name only once whole (written
under a hidden temporary name, then renamed), so an uploader never ships half a bundle.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tarfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memwatch_engine.dirfd import create_exclusive, open_dir, open_regular

from ..errors import MemwatchError
from ..store.db import Database
from ..store.retention import NS
from ..store.run_model import StoredRun, load_run
from . import manifest as m
from . import pgzip
from .run_copy import copy_run, full_from, full_span, shorten
from .scratch import PART_PREFIX, WorkDir

if TYPE_CHECKING:
    from ..detectors import DetectorConfig

DEFAULT_CAP_BYTES = 64 * 1024 * 1024
MIN_WINDOW_NS = 10 * NS
"""The shortest full-resolution window a bundle is cut to before its log tail goes."""
LOG_TAIL_BYTES = 256 * 1024
"""The most of the sidecar's log a bundle keeps (its last lines)."""
COMPRESS_LEVEL = 1
"""gzip's fastest level: on a 15-minute window of 8 ranks it is 5 % larger than level 6 and takes a quarter of the
time (bench/bench_bundle.py); the build must fit a pod's termination grace period."""

class BundleTooLarge(MemwatchError):
    """Even at the shortest window and without its log, the bundle is over the cap."""


@dataclass(frozen=True)
class Built:
    path: Path
    manifest: m.Manifest
    seconds: float

    @property
    def name(self) -> str:
        return self.path.name


def bundle_name(created_ns: int, place: str | None, run_id: str) -> str:
    """``memwatch-incident-<utc>-<pod or host>-<run>.tar.gz``, every part reduced to ``[A-Za-z0-9._-]``; the time
    to the millisecond (``20261204T013158.123Z``), so that two bundles of one run (a flag's, then its end's) differ."""
    utc = time.strftime("%Y%m%dT%H%M%S", time.gmtime(created_ns // NS)) + f".{created_ns // 1_000_000 % 1000:03d}Z"
    return f"memwatch-incident-{utc}-{_safe(place or 'unknown', 63)}-{_safe(run_id, 64)}.tar.gz"


def _safe(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:limit].lstrip(".") or "_"


def build_bundle(db: Database, run_id: str, trigger: str, out_dir: Path, *, cap_bytes: int = DEFAULT_CAP_BYTES,
                 identity: Mapping[str, str | None] | None = None, log_tail: bytes | None = None,
                 config: DetectorConfig | None = None, clock: Callable[[], int] = time.time_ns) -> Path:
    """Build the bundle of ``run_id`` (an id, prefix or ``latest``) from ``db`` into ``out_dir``; its path."""
    return build(db, run_id, trigger, out_dir, cap_bytes=cap_bytes, identity=identity, log_tail=log_tail,
                 config=config, clock=clock).path


def build(db: Database, ref: str, trigger: str, out_dir: Path, *, cap_bytes: int = DEFAULT_CAP_BYTES,
          identity: Mapping[str, str | None] | None = None, log_tail: bytes | None = None,
          config: DetectorConfig | None = None, clock: Callable[[], int] = time.time_ns) -> Built:
    """:func:`build_bundle`, with the manifest and how long it took."""
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    dir_fd = open_dir(out_dir)
    try:
        return build_at(db, ref, trigger, dir_fd, out_dir, cap_bytes=cap_bytes, identity=identity,
                        log_tail=log_tail, config=config, created_ns=clock())
    finally:
        os.close(dir_fd)


def build_at(db: Database, ref: str, trigger: str, dir_fd: int, shown: Path, *, cap_bytes: int = DEFAULT_CAP_BYTES,
             identity: Mapping[str, str | None] | None = None, log_tail: bytes | None = None,
             config: DetectorConfig | None = None, created_ns: int | None = None, name: str | None = None) -> Built:
    """Build the bundle of ``ref`` into the folder ``dir_fd`` (shown as ``shown``), its scratch files in a private
    work folder there (:mod:`memwatch.incident.scratch`).

    ``created_ns`` dates the bundle and names it; a ``name`` given is the only one tried, and a bundle already under
    it raises ``FileExistsError`` (a decided incident has one name, whoever builds it).
    """
    started = time.monotonic()
    model = load_run(db, ref, config)
    run = model.run
    created = time.time_ns() if created_ns is None else created_ns
    place = _identity(db, run.run_id, identity)
    source = _source_path(db)
    with WorkDir(dir_fd) as work, ThreadPoolExecutor(pgzip.workers() + 1, thread_name_prefix="memwatch-bundle") as pool:
        database = work.path(m.DATABASE)
        pending = pool.submit(_accounts, model)  # SQLite lets go of the GIL: both go at once
        copy_run(source, database, run.run_id)
        tail = (log_tail or b"")[-LOG_TAIL_BYTES:]
        dropped: list[str] = []
        window: dict[str, int | None] = {"full_from_ns": full_from(database)}
        rolled = 0
        shrinkable = True
        while True:
            content = _read(work.fd, m.DATABASE)
            early = pgzip.start(pool, content, COMPRESS_LEVEL)  # deflated while the manifest is put together
            digests = {m.DATABASE: m.digest(content)}
            accounts = pending.result()
            files = {m.DATABASE: content, **accounts}
            if tail:
                files[m.LOG] = tail
            digests.update((name, m.digest(data)) for name, data in files.items() if name != m.DATABASE)
            window["full_seconds_dropped"] = rolled
            made = m.Manifest(run_id=run.run_id, created_ns=created, trigger=trigger,
                              verdict=json.loads(accounts[m.EXPLAIN])["outcome"],
                              identity=place, files={name: digests[name] for name in files},
                              window=dict(window), dropped=tuple(dropped))
            archive = _archive(made, files, created, pool, early)
            if len(archive) <= cap_bytes:
                break
            span = full_span(database)
            more = 0
            if span > MIN_WINDOW_NS and shrinkable:
                keep = max(MIN_WINDOW_NS, int(span * cap_bytes / len(archive) * 0.8))
                more = shorten(database, run.run_id, keep)
                shrinkable = more > 0 and keep > MIN_WINDOW_NS  # at the shortest window, or nothing left to roll
            if more:
                rolled += more
                window["full_from_ns"] = full_from(database)
                if "full-resolution window shortened" not in dropped:
                    dropped.append("full-resolution window shortened")
            elif tail:
                tail = b""
                dropped.append("sidecar log tail cut")
            else:
                raise BundleTooLarge(
                    f"the bundle of run {run.run_id} is {len(archive):,} bytes with only {MIN_WINDOW_NS // NS} s at "
                    f"full resolution, over the cap of {cap_bytes:,} bytes; raise the cap")
    where = place.get("k8s_pod") or place.get("hostname")
    named: Callable[[int], str] = (lambda later: bundle_name(created + later * 1_000_000, where, run.run_id)) \
        if name is None else (lambda later: name)
    final = _publish_at(dir_fd, shown, named, archive, tries=1000 if name is None else 1)
    return Built(shown / final, made, time.monotonic() - started)


def decided_name(db: Database, run_id: str, decided_ns: int, taken: Callable[[str], bool]) -> str:
    """The name of the bundle of ``run_id`` decided at ``decided_ns``: dated then, or a millisecond later, and so on,
    until ``taken`` says no other bundle has it (two flags of one run decided in one commit)."""
    place = _identity(db, run_id, None)
    where = place.get("k8s_pod") or place.get("hostname")
    for later in range(1000):
        name = bundle_name(decided_ns + later * 1_000_000, where, run_id)
        if not taken(name):
            return name
    raise MemwatchError(f"a thousand bundles named like {name} are already decided")


def _read(dir_fd: int, name: str) -> bytes:
    fd, info = open_regular(dir_fd, name)
    with os.fdopen(fd, "rb") as f:
        return f.read(info.st_size)


def _accounts(model: StoredRun) -> dict[str, bytes]:
    """The JSON files, from the database the bundle is built from: the same numbers ``check``, ``explain`` and
    ``flags`` print for the run, read once through the run's model (:mod:`memwatch.store.run_model`)."""
    from ..report.check import check_stored
    from ..report.explain import explain_stored
    from ..snapshot.importer import SNAPSHOT_KINDS
    db, run_id = model.db, model.run_id
    truth = model.figures
    ledger = {"run": truth.to_dict(), "ranks": [rank.to_dict() for rank in truth.ranks],
              "check": check_stored(model).to_dict()}
    flags = [{"rank": rank, "step": step, "ts_ns": ts, "kind": kind, "severity": severity, "message": message,
              "data": _json(data)}
              for rank, step, ts, kind, severity, message, data in db.execute(
                 """SELECT rank, step, ts_ns, kind, severity, message, data FROM flags WHERE run_id = ?
                    ORDER BY ts_ns, rowid""", (run_id,))]
    lines = []
    snapshot = []
    for event in model.events:
        row = {"rank": event.rank, "step": event.step, "ts_ns": event.ts_ns, "kind": event.kind, "data": event.data}
        lines.append(json.dumps(row, sort_keys=True))
        if event.kind in SNAPSHOT_KINDS:
            snapshot.append(row)
    files = {m.LEDGER: _dump(ledger), m.FLAGS: _dump(flags), m.EXPLAIN: _dump(explain_stored(model).to_dict()),
             m.EVENTS: ("\n".join(lines) + "\n" if lines else "").encode()}
    if snapshot:
        files[m.SNAPSHOT] = _dump(snapshot)
    return files


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


def _dump(value: Any) -> bytes:
    return json.dumps(value, indent=1, sort_keys=True, default=str).encode()


def _identity(db: Database, run_id: str, extra: Mapping[str, str | None] | None) -> dict[str, str | None]:
    """Where and on what the run ran: the ``runs`` row, its config, then what the caller knows (the ring's
    metadata, the driver); each value a bounded string or None."""
    columns = {row[1] for row in db.execute("""PRAGMA table_info(runs)""")}
    wanted = [key for key in m.IDENTITY_KEYS if key in columns]
    row = db.execute(f"SELECT {', '.join(wanted)}, config FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    found: dict[str, Any] = dict(zip(wanted, row[:-1], strict=True)) if row else {}
    config = _json(row[-1]) if row else {}
    for key in m.IDENTITY_KEYS:
        if found.get(key) is None and isinstance(config, dict):
            found[key] = config.get(key)
        if extra and extra.get(key) is not None:
            found[key] = extra[key]
    return {key: str(found[key])[:m.MAX_TEXT] if found.get(key) is not None else None for key in m.IDENTITY_KEYS}


def _source_path(db: Database) -> str:
    for _, name, file in db.execute("""PRAGMA database_list"""):
        if name == "main" and file:
            return str(file)
    raise MemwatchError("a bundle is built from a database file, not an in-memory database")


def _archive(made: m.Manifest, files: Mapping[str, bytes], created_ns: int, pool: Executor | None = None,
             early: pgzip.Early | None = None) -> bytes:
    """The tar.gz of the manifest and the files, in :data:`~memwatch.incident.manifest.MEMBERS` order: regular
    files only, owned by nobody in particular, dated the bundle's moment; the tar laid out as ``tarfile`` writes it,
    compressed on every core (:mod:`memwatch.incident.pgzip`), ``run.db`` from ``early`` when its deflating began
    already."""
    chunks: list[bytes | pgzip.Early] = []
    offset = 0
    for name in m.MEMBERS:
        data = made.encode() if name == m.MANIFEST else files.get(name)
        if data is None:
            continue
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, created_ns // NS
        header = info.tobuf(tarfile.PAX_FORMAT)
        padding = b"\0" * (-len(data) % tarfile.BLOCKSIZE)
        chunks += [header, early if early is not None and name == m.DATABASE else data, padding]
        offset += len(header) + len(data) + len(padding)
    offset += 2 * tarfile.BLOCKSIZE  # the end of the archive, then padded to a whole record
    chunks.append(b"\0" * (2 * tarfile.BLOCKSIZE + -offset % tarfile.RECORDSIZE))
    return pgzip.compress(chunks, COMPRESS_LEVEL, created_ns // NS, pool)


def _publish_at(dir_fd: int, shown: Path, name: Callable[[int], str], data: bytes, tries: int = 1000) -> str:
    """Write ``data`` into the folder ``dir_fd`` atomically under ``name(0)``: a hidden temporary file, synced, then
    linked to its name, which is never overwritten (taken: ``name(1)``, a millisecond later, and so on, ``tries``
    names in all); the name used.

    Through the folder's descriptor and names within it only: the folder may be one another user can write (a
    shared ``--out``), and no path is looked up twice."""
    temporary = f"{PART_PREFIX}{os.getpid()}-{secrets.token_hex(8)}.part"
    try:
        fd = create_exclusive(dir_fd, temporary, 0o600, os.O_WRONLY)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        for later in range(tries):
            final = name(later)
            try:
                os.link(temporary, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                os.fsync(dir_fd)
                return final
            except FileExistsError:
                if tries == 1:
                    raise
                continue
        raise MemwatchError(f"a thousand bundles named like {name(0)} are already in {shown}")
    finally:
        try:
            os.unlink(temporary, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
