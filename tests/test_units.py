"""Sizes written back to a person: binary units, exact or rounded down, and a flag value that
``parse_bytes`` reads back as at least the size asked for."""

from __future__ import annotations

import pytest

from pagedkv.units import format_bytes, parse_bytes, size_at_least


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(0, "0 B"), (500, "500 B"), (46080, "45 KiB"), (16383, "15.999 KiB"),
     (94371840, "90 MiB"), (3 * 2**30, "3 GiB"), (2**31 - 1, "1.999 GiB")],
)  # fmt: skip
def test_format_bytes_is_exact_or_rounded_down(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(500, "500"), (16384, "16KiB"), (16385, "17KiB"), (188743680, "180MiB"),
     (3 * 2**30 + 1, "3073MiB")],
)  # fmt: skip
def test_size_at_least_is_a_flag_value_no_smaller(num_bytes: int, text: str) -> None:
    assert size_at_least(num_bytes) == text
    assert parse_bytes("--kv-cache-memory", text) >= num_bytes
