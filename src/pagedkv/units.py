"""Parsing of human-written quantities at the edges (CLI, server). ValueError when unreadable."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_bytes(text: str | int, what: str = "size") -> int:
    """'58GiB' -> 62277025792, '80GB' -> 8e10, '4096' -> 4096 (bare numbers are bytes)."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(f"{what}: expected a size such as 58GiB, 80GB or 4096, got {text!r}")
        value = round(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"{what}: must be positive, got {text!r}")
    return value
