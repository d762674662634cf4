"""Sizes, bandwidths, durations, rank lists and tables as people write and read them."""

import pytest

from overlapkit.topology.units import (
    format_bytes,
    format_seconds,
    parse_bandwidth,
    parse_duration,
    parse_size,
    rank_ranges,
    text_table,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("140e9", 140e9),
        ("140GB", 140e9),
        ("1.5GiB", 1.5 * 2**30),
        ("4KiB", 4096),
        ("256 MiB", 256 * 2**20),
        ("0", 0.0),
        (12, 12.0),
        ("2kB", 2000.0),
    ],
)
def test_parse_size_reads_decimal_binary_and_bare_bytes(text, expected):
    assert parse_size(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["-1", "-3GB", "abc", "1.5iB", "nan", "inf", "140Gb"])
def test_parse_size_rejects_negative_unreadable_and_bits(text):
    with pytest.raises(ValueError, match="--bytes"):
        parse_size(text, what="--bytes")


def test_parse_size_rejects_bool():
    with pytest.raises(TypeError):
        parse_size(True)


@pytest.mark.parametrize(
    ("text", "gbps"),
    [
        ("1.8TB/s", 1800),
        ("50GB/s", 50),
        ("400Gbit/s", 50),
        ("400Gb/s", 50),
        ("400Gbps", 50),
        ("8gbit", 1),
        ("50", 50),
        (2.5, 2.5),
        ("1GiB/s", 2**30 / 1e9),
        ("800 Mbit/s", 0.1),
    ],
)
def test_parse_bandwidth_tells_bits_from_bytes(text, gbps):
    assert parse_bandwidth(text) == pytest.approx(gbps)


@pytest.mark.parametrize("text", ["0", "-5GB/s", "50G", "fast", "0GB/s"])
def test_parse_bandwidth_rejects_non_positive_and_unitless_prefix(text):
    with pytest.raises(ValueError, match="--bandwidth"):
        parse_bandwidth(text, what="--bandwidth")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5us", 5e-6), ("2.5ms", 2.5e-3), ("1e-6", 1e-6), ("0", 0.0), ("3s", 3.0), ("100ns", 1e-7)],
)
def test_parse_duration_reads_units_and_bare_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_parse_duration_rejects_negative():
    with pytest.raises(ValueError, match="--latency"):
        parse_duration("-1us", what="--latency")


def test_format_bytes_uses_binary_units_when_exact():
    assert format_bytes(4 * 2**20) == "4 MiB"
    assert format_bytes(1.5 * 2**30) == "1.5 GiB"
    assert format_bytes(140e9) == "140 GB"
    assert format_bytes(300) == "300 B"


def test_format_seconds_picks_a_readable_unit():
    assert format_seconds(0.1554) == "155.4 ms"
    assert format_seconds(3.2e-5) == "32 us"
    assert format_seconds(5.6) == "5.6 s"


def test_rank_ranges_fold_consecutive_ranks():
    assert rank_ranges([0, 1, 2, 3, 8, 9, 11]) == "0-3,8-9,11"
    assert rank_ranges([]) == ""


def test_text_table_aligns_columns_to_the_widest_cell_and_strips_trailing_space():
    lines = text_table(["#", "ranks"], [["0", "0-7"], ["10", "8"]])
    assert lines == ["  #   ranks", "  0   0-7", "  10  8"]
