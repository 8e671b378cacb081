"""Parsing and formatting of counts and byte sizes (what the CLI's --seq-len/--memory take)."""

import pytest

from gradshard.cost.units import (format_bytes, format_count, format_flops, format_seconds, parse_bytes,
                                  parse_count, parse_counts)


@pytest.mark.parametrize("text, value", [
    ("1k", 1000), ("64k", 64000), ("1M", 1_000_000), ("1.5M", 1_500_000), ("2G", 2 * 10**9), ("1Ki", 1024),
    ("64Ki", 65536), ("1Mi", 2**20), ("2^20", 2**20), ("2**10", 1024), ("1e6", 10**6), ("1_000_000", 10**6),
    ("4096", 4096), (" 8k ", 8000), (7, 7),
])
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "k", "1.5", "-3", "1x", "ten", "1.0001k"])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError):
        parse_count(text)


def test_parse_counts_list():
    assert parse_counts("1k,64k,1M") == [1000, 64000, 1_000_000]
    assert parse_counts("1k, 2k") == [1000, 2000]
    assert parse_counts(["1k", 5]) == [1000, 5]
    with pytest.raises(ValueError):
        parse_counts(",")


@pytest.mark.parametrize("text, value", [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("80 GB", 80 * 10**9), ("24G", 24 * 10**9), ("24Gi", 24 * 2**30),
    ("512MiB", 512 * 2**20), ("1.5TB", 1_500_000_000_000), ("100", 100), ("100B", 100), (1e9, 10**9), (4096, 4096),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["80XB", "GB", "-1GB", "h100", "0.5B"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_formatting():
    assert format_count(1_000_000) == "1M"
    assert format_count(65536) == "65.5k"
    assert format_count(12) == "12"
    assert format_bytes(80 * 2**30) == "80 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(100) == "100 B"
    assert format_flops(2.4e12) == "2.4 TFLOP"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(3.0) == "3 s"
