"""One ordinary gzip stream, compressed on every core the process may use: how a bundle's tar is compressed.

The data is cut into pieces of :data:`PIECE` bytes, each deflated on its own (in threads: zlib lets go of the
GIL), every piece but the last ended by a sync flush so that the raw deflate streams join into one (as ``pigz``
does); one gzip header, the joined stream, then the CRC-32 and length of the whole. Any gzip reader reads it as a
single member. A piece does not refer back into the one before it, which costs well under 1 % in size.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

PIECE = 4 << 20
MAX_WORKERS = 4


def workers() -> int:
    """The cores this process may run on (at most :data:`MAX_WORKERS`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


def pieces(chunks: Iterable[bytes]) -> list[bytes | memoryview]:
    """``chunks`` regrouped into pieces of about :data:`PIECE` bytes (small chunks joined, large ones sliced)."""
    out: list[bytes | memoryview] = []
    small = bytearray()
    for chunk in chunks:
        view = memoryview(chunk)
        while len(view):
            room = PIECE - len(small)
            if len(small) == 0 and len(view) >= PIECE:
                out.append(view[:PIECE])
                view = view[PIECE:]
                continue
            small += view[:room]
            view = view[room:]
            if len(small) == PIECE:
                out.append(bytes(small))
                small = bytearray()
    if small or not out:
        out.append(bytes(small))
    return out


@dataclass(frozen=True)
class Early:
    """A chunk whose pieces are being deflated already (:func:`start`), before what comes ahead of it is known."""

    data: bytes
    parts: list[Future[bytes]]


def _deflate(piece: bytes | memoryview, level: int, final: bool) -> bytes:
    compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
    return compressor.compress(piece) + compressor.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)


def start(pool: Executor, data: bytes, level: int) -> Early:
    """Begin deflating ``data`` in ``pool``, as a chunk that is not the stream's last."""
    view = memoryview(data)
    return Early(data, [pool.submit(_deflate, view[i:i + PIECE], level, False) for i in range(0, len(view), PIECE)])


def compress(chunks: Iterable[bytes | Early], level: int, mtime: int, pool: Executor | None = None) -> bytes:
    """The gzip of the concatenation of ``chunks`` at ``level``, its header dated ``mtime`` (seconds); the last
    chunk must not be :class:`Early`. In ``pool`` when given, else in threads of its own."""
    if pool is None:
        with ThreadPoolExecutor(workers(), thread_name_prefix="memwatch-gzip") as own:
            return compress(chunks, level, mtime, own)
    runs: list[list[bytes] | Early] = []
    for chunk in chunks:
        if isinstance(chunk, Early):
            runs.append(chunk)
        elif runs and isinstance(runs[-1], list):
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    if not runs or isinstance(runs[-1], Early):
        runs.append([b""])
    deflated: list[Future[bytes]] = []
    raw: list[bytes | memoryview] = []
    for number, run in enumerate(runs):
        if isinstance(run, Early):
            deflated += run.parts
            raw.append(run.data)
            continue
        parts = pieces(run)
        final = number == len(runs) - 1
        deflated += [pool.submit(_deflate, part, level, final and i == len(parts) - 1) for i, part in enumerate(parts)]
        raw += parts
    crc, size = 0, 0
    for part in raw:  # meanwhile, here: the checksum of the whole
        crc = zlib.crc32(part, crc)
        size += len(part)
    body = b"".join(future.result() for future in deflated)
    extra = 4 if level == 1 else 2 if level == 9 else 0  # XFL: fastest, or best, compression
    header = b"\x1f\x8b\x08\x00" + struct.pack("<I", mtime & 0xFFFFFFFF) + bytes((extra, 255))
    return header + body + struct.pack("<II", crc, size & 0xFFFFFFFF)
