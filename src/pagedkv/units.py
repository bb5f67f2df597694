"""Parsing of human-written quantities at the edges (CLI, server). Each parser names the option
it reads in its ValueError, which the CLI prints as one line (exit code 2)."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_bytes(option: str, text: str) -> int:
    """'58GiB' -> 62277025792, '80GB' -> 8e10, '4096' -> 4096 (bare numbers are bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{option}: expected a size such as 58GiB, 80GB or 4096, got {text!r}")
    return round(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_tokens(option: str, text: str) -> int:
    """'6144' -> 6144; '32k' -> 32768 (k = 1024 tokens, as '32k context' is usually meant)."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([kK]?)\s*", text)
    if match is None:
        raise ValueError(f"{option}: expected a whole number of tokens (or e.g. 32k), got {text!r}")
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def parse_count(option: str, text: str) -> int:
    """A whole number of things (sequences, hits): '128' -> 128."""
    if not text.strip().isdigit():
        raise ValueError(f"{option}: expected a whole number, got {text!r}")
    return int(text)


def parse_int_list(option: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{option}: give at least one value")
    return values
