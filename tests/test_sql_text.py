"""SQLite formats a timeline row exactly as Python does: the byte sizes, half-way cases and blanks included."""

from __future__ import annotations

import random
import sqlite3

from memwatch.store.sql_text import bytes_sql
from memwatch.units import format_bytes


def _formatted(values: list[int | None]) -> list[str]:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (i INTEGER, x INTEGER)")
    conn.executemany("INSERT INTO t VALUES (?, ?)", list(enumerate(values)))
    return [text for (text,) in conn.execute(f"SELECT {bytes_sql('x')} FROM t ORDER BY i")]


def test_hand_worked_sizes() -> None:
    gib, mib = 1 << 30, 1 << 20
    cases = {
        None: "-", 0: "0 B", 1023: "1023 B", 1024: "1.00 KiB", -2048: "-2.00 KiB",
        gib + gib // 8: "1.12 GiB",  # 1.125 exactly: half to even, down
        gib + 3 * gib // 8: "1.38 GiB",  # 1.375 exactly: half to even, up
        gib - 1: "1024.00 MiB",  # a hair under 1 GiB rounds up within MiB
        5 * mib + mib // 200: "5.00 MiB",  # 5.005 MiB: under the half (mib / 200 is rounded down)
        80 * gib: "80.00 GiB", 3 << 40: "3.00 TiB",
    }
    assert _formatted(list(cases)) == list(cases.values())


def test_agrees_with_format_bytes_on_many_sizes() -> None:
    rng = random.Random(14)
    values: list[int | None] = []
    for _ in range(20_000):
        value = rng.randrange(0, 1 << rng.choice((10, 20, 30, 40, 45)))
        if rng.random() < 0.3:
            value = value >> 10 << 10  # whole KiB: many exact half-way cases
        values.append(-value if rng.random() < 0.1 else value)
    assert _formatted(values) == [format_bytes(value) for value in values]


def test_timeline_rows_match_the_python_table() -> None:
    """Whole rows, SQLite's against the timeline's own Python formatting, over sizes of every kind and blanks."""
    from memwatch.cli.timeline import _engine_line, _nvml_line
    from memwatch.records import SAMPLE_COLUMNS, Sample
    from memwatch.store.sql_text import ENGINE_LINE, NVML_LINE, timed_line_sql
    from memwatch.store.window import RAW_SELECT, WindowRow

    rng = random.Random(7)

    def size() -> int | None:
        whole_kib = rng.randrange(0, 1 << rng.choice((20, 30, 37, 41))) >> 10 << 10
        return rng.choice([None, rng.randrange(0, 1024), whole_kib, rng.randrange(1 << 30, 100 << 30),
                           -rng.randrange(1 << 20, 1 << 31)])  # negative: a difference, printed with its sign

    conn = sqlite3.connect(":memory:")
    columns = SAMPLE_COLUMNS[1:]
    conn.execute(f"CREATE TABLE sample_rows ({', '.join(columns)})")
    rows = [(rng.randrange(8), rng.randrange(10**6), 10**18 + rng.choice([i, i * 500_000, i * 1_234_567, -i * 999]),
             rng.choice([None, "", "serve"]),
             *(size() for _ in range(5)), rng.choice([None, 7]), rng.choice([None, 40]), 1, 2,
             rng.choice([None, "decode"]), 1, size(), *(None,) * 5) for i in range(3000)]
    conn.executemany(f"INSERT INTO sample_rows VALUES ({', '.join('?' * len(columns))})", rows)
    start = 10**18
    for line_sql, python in ((ENGINE_LINE, _engine_line), (NVML_LINE, _nvml_line)):
        timed = timed_line_sql(line_sql, start)
        got = conn.execute(f"SELECT {timed}, {RAW_SELECT} FROM sample_rows ORDER BY ts_ns").fetchall()
        for text, *values in got:
            expected = python(WindowRow(Sample.from_row(("r", *values)), None), start, format_bytes)
            assert text == expected


def test_the_time_column_rounds_exact_halves_to_even() -> None:
    """Seconds to the millisecond from whole nanoseconds, by hand: Python's rule and SQLite's alike."""
    from memwatch.store.sql_text import offset_s_sql
    from memwatch.units import format_offset_s

    cases = {0: "0.000", 1: "0.000", 499_999: "0.000", 500_000: "0.000", 500_001: "0.001", 1_500_000: "0.002",
             2_500_000: "0.002", 999_999_999: "1.000", 3_094_990_000_000: "3094.990", -1: "-0.000",
             -1_500_000: "-0.002", -2_000_000_001: "-2.000"}
    conn = sqlite3.connect(":memory:")
    sql = f"SELECT {offset_s_sql(':t', 10**18)}"
    for offset, text in cases.items():
        assert format_offset_s(offset) == text, offset
        assert conn.execute(sql, {"t": 10**18 + offset}).fetchone()[0] == text, offset
    # Away from exact halves the rule is Python's float formatting, as the timeline printed it before.
    rng = random.Random(11)
    for offset in (rng.randrange(-10**12, 10**14) for _ in range(20_000)):
        if abs(offset) % 1_000_000 != 500_000:
            assert format_offset_s(offset) == f"{offset / 1e9:.3f}", offset
