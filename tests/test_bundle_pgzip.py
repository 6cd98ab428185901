"""A bundle's gzip, compressed in pieces on several cores, is one ordinary gzip member any reader reads.

Each expectation comes from RFC 1952 (the header's fields, the trailer's CRC-32 and length) or from the piece size:
an input of ``k`` pieces and a bit is deflated as ``k + 1`` independent raw streams joined by sync flushes.
"""

from __future__ import annotations

import gzip
import os
import random
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from memwatch.incident import pgzip


def _noise(n: int, seed: int = 7) -> bytes:
    return random.Random(seed).randbytes(n)


def _one_member(blob: bytes) -> bytes:
    """The data of ``blob`` read as exactly one gzip member (nothing after its trailer)."""
    reader = zlib.decompressobj(16 + zlib.MAX_WBITS)
    data = reader.decompress(blob) + reader.flush()
    assert reader.eof and reader.unused_data == b"", "more than one gzip member, or a truncated one"
    return data


@pytest.mark.parametrize("sizes", [[0], [1], [pgzip.PIECE], [pgzip.PIECE + 1],
                                   [100, pgzip.PIECE - 50, 3 * pgzip.PIECE + 17, 5], [10] * 50])
def test_the_stream_is_one_member_holding_the_joined_chunks(sizes: list[int]) -> None:
    chunks = [_noise(n, seed=i) + b"text " * (n % 7) for i, n in enumerate(sizes)]
    blob = pgzip.compress(chunks, 6, mtime=1_700_000_000)
    whole = b"".join(chunks)
    assert _one_member(blob) == whole
    assert gzip.decompress(blob) == whole
    crc, size = struct.unpack("<II", blob[-8:])
    assert (crc, size) == (zlib.crc32(whole), len(whole))


@pytest.mark.parametrize(("level", "xfl"), [(1, 4), (9, 2), (6, 0)])
def test_the_header_is_rfc_1952s_with_the_given_time_and_the_level_flag(level: int, xfl: int) -> None:
    blob = pgzip.compress([b"x" * 1000], level, mtime=(1 << 32) + 12345)
    assert blob[:4] == b"\x1f\x8b\x08\x00"  # magic, deflate, no flags
    assert struct.unpack("<I", blob[4:8])[0] == 12345  # modulo 2**32, as the field holds
    assert blob[8] == xfl and blob[9] == 255  # XFL; OS "unknown"


def test_early_chunks_deflated_ahead_join_the_same_stream() -> None:
    head, body = _noise(pgzip.PIECE + 10, seed=1), b"manifest " * 100
    with ThreadPoolExecutor(2) as pool:
        early = pgzip.start(pool, head, 6)
        assert len(early.parts) == 2  # one full piece and ten bytes
        blob = pgzip.compress([body, early, b"tail"], 6, mtime=0, pool=pool)
    assert _one_member(blob) == body + head + b"tail"


def test_a_stream_ending_on_an_early_chunk_is_still_finished() -> None:
    with ThreadPoolExecutor(2) as pool:
        blob = pgzip.compress([pgzip.start(pool, b"abc" * 10, 6)], 6, mtime=0, pool=pool)
    assert _one_member(blob) == b"abc" * 10


def test_nothing_compresses_to_an_empty_member() -> None:
    assert _one_member(pgzip.compress([], 6, mtime=0)) == b""


def test_pieces_are_whole_pieces_but_the_last_and_keep_every_byte() -> None:
    piece = pgzip.PIECE
    chunks = [b"a" * 10, b"b" * (piece + 5), b"c" * (2 * piece), b"d" * 3]
    out = pgzip.pieces(chunks)
    assert [len(p) for p in out] == [piece, piece, piece, 18]
    assert b"".join(bytes(p) for p in out) == b"".join(chunks)
    assert [len(p) for p in pgzip.pieces([b"z" * piece])] == [piece]
    assert pgzip.pieces([]) == [b""]


def test_each_piece_is_deflated_on_its_own() -> None:
    """A piece does not refer back into the one before it: each raw stream decompresses alone."""
    data = b"0123456789abcdef" * (pgzip.PIECE // 8)  # two pieces, each repeating the other
    with ThreadPoolExecutor(2) as pool:
        early = pgzip.start(pool, data, 6)
        parts = [f.result() for f in early.parts]
    assert len(parts) == 2
    for part in parts:
        raw = zlib.decompressobj(-zlib.MAX_WBITS)
        assert raw.decompress(part) == data[:pgzip.PIECE]
        assert not raw.eof  # a sync flush, not the stream's end


def test_workers_are_the_cores_this_process_may_use_up_to_four() -> None:
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert pgzip.workers() == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert pgzip.workers() == min(pgzip.MAX_WORKERS, len(allowed))
    assert pgzip.MAX_WORKERS == 4


def test_workers_fall_back_to_the_cpu_count_where_affinity_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def unknown(pid: int) -> set[int]:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(pgzip.os, "sched_getaffinity", unknown)
    for count, expected in ((None, 1), (1, 1), (3, 3), (64, 4)):
        monkeypatch.setattr(pgzip.os, "cpu_count", lambda count=count: count)
        assert pgzip.workers() == expected, count


def test_a_chunk_of_whole_pieces_is_sliced_not_copied() -> None:
    piece = pgzip.PIECE
    out = pgzip.pieces([b"a" * piece, b"b" * (2 * piece)])
    assert [type(p) for p in out] == [memoryview, memoryview, memoryview]
    assert [bytes(p[:1]) for p in out] == [b"a", b"b", b"b"]


def test_its_own_threads_are_named_and_as_many_as_the_cores_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[object, str]] = []

    class Recording(ThreadPoolExecutor):
        def __init__(self, max_workers: int | None = None, thread_name_prefix: str = "") -> None:
            made.append((max_workers, thread_name_prefix))
            super().__init__(max_workers, thread_name_prefix)

    monkeypatch.setattr(pgzip, "ThreadPoolExecutor", Recording)
    assert gzip.decompress(pgzip.compress([b"q" * 10], 6, mtime=0)) == b"q" * 10
    assert made == [(pgzip.workers(), "memwatch-gzip")]


def test_a_time_past_2038_fits_the_header_as_an_unsigned_field() -> None:
    blob = pgzip.compress([b"x"], 6, mtime=3_000_000_000)
    assert struct.unpack("<I", blob[4:8])[0] == 3_000_000_000
