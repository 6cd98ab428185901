"""Byte sizes: GB is 10^9, GiB is 2^30, parsing is exact, formatting says which unit it means."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memwatch.errors import UsageError
from memwatch.units import GIB, SizeError, format_bytes, format_bytes_si, parse_bytes


@pytest.mark.parametrize(("text", "expected"), [
    ("25769803776", 25_769_803_776),
    ("24GiB", 24 * 2**30),
    ("24 GiB", 24 * 2**30),
    ("24gib", 24 * 2**30),
    ("24GB", 24 * 10**9),
    ("24 GB", 24 * 10**9),
    ("1.5GiB", 1_610_612_736),          # 1.5 × 2^30, exact
    ("4.6GiB", 4_939_212_390),          # 4.6 × 2^30 = 4,939,212,390.4, nearest byte
    ("512 MiB", 512 * 2**20),
    ("2KiB", 2048),
    ("3kB", 3000),
    ("1TB", 10**12),
    ("1TiB", 2**40),
    ("100 B", 100),
    ("1e9", 10**9),
    (".5GB", 500_000_000),
    (4096, 4096),
])
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "24 GX", "-5GB", "1.2.3GB", "GiB", "24 Gibibytes", "1e99999999999GB"])
def test_parse_bytes_refuses_with_one_line(text: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_bytes(text)
    assert "invalid size" in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, UsageError) and info.value.exit_code == 2


def test_negative_and_boolean_counts_are_refused() -> None:
    with pytest.raises(SizeError, match="cannot be negative"):
        parse_bytes(-1)
    with pytest.raises(SizeError):
        parse_bytes(True)


@pytest.mark.parametrize(("num_bytes", "expected"), [
    (4_939_212_390, "4.60 GiB"),
    (-2_576_980_378, "-2.40 GiB"),
    (7 * GIB, "7.00 GiB"),
    (57_344, "56.00 KiB"),
    (14_680_064, "14.00 MiB"),
    (1023, "1023 B"),
    (0, "0 B"),
    (2**40 * 3, "3.00 TiB"),
])
def test_format_bytes(num_bytes: int, expected: str) -> None:
    assert format_bytes(num_bytes) == expected


def test_format_bytes_si() -> None:
    assert format_bytes_si(25_769_803_776) == "25.77 GB"
    assert format_bytes_si(80 * 10**9) == "80.00 GB"
    assert format_bytes_si(999) == "999 B"
    assert format_bytes(1_610_612_736, decimals=1) == "1.5 GiB"


def test_missing_readings_print_as_a_dash() -> None:
    assert format_bytes(None) == format_bytes_si(None) == "-"


@given(st.integers(min_value=0, max_value=2**50))
def test_plain_counts_round_trip(count: int) -> None:
    assert parse_bytes(str(count)) == count
    assert parse_bytes(f"{count}B") == count
