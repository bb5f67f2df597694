"""Parsing of human-written quantities at the edges (CLI, server), and the one way a size is
written back to a person. Each parser names the option it reads in its ``UsageError``, which
the CLI prints as one line (exit code 2).

Every parser refuses what no later computation can hold: non-finite numbers (``nan``, ``inf``)
and values beyond a stated ceiling (a 400-digit size would otherwise overflow a float deep
inside the planner). Digits are ASCII only: ``int("²")`` fails, ``"²".isdigit()`` does not.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from pagedkv.errors import UsageError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

MAX_BYTES = 2**60  # 1 EiB: far above any device, far below a float's range
MAX_TOKENS = 2**40  # token counts (lengths, budgets): about 10^12
MAX_COUNT = 2**40  # counts of things (sequences, hits, requests)


def parse_bytes(option: str, text: str, minimum: int = 0) -> int:
    """'58GiB' -> 62277025792, '80GB' -> 8e10, '4096' -> 4096 (bare numbers are bytes).

    Computed exactly (no float), then refused below ``minimum`` or above ``MAX_BYTES``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text, re.ASCII)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise UsageError(
            f"{option}: expected a size such as 58GiB, 80GB or 4096, got {text!r}", option
        )
    if len(match.group(1)) > 40:  # Fraction of a huge literal is slow; no size needs 40 digits
        raise UsageError(f"{option}: {text!r} is more than {MAX_BYTES} bytes (1 EiB)", option)
    value = round(Fraction(match.group(1)) * _SIZE_UNITS[unit])
    if value > MAX_BYTES:
        raise UsageError(f"{option}: {text!r} is more than {MAX_BYTES} bytes (1 EiB)", option)
    if value < minimum:
        raise UsageError(f"{option} must be at least {format_bytes(minimum)}, got {text!r}", option)
    return value


_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(num_bytes: int) -> str:
    """94371840 -> '90 MiB', 16383 -> '15.999 KiB', 500 -> '500 B': the largest binary unit
    the size reaches, whole when exact, else three decimals rounded down (a size short of a
    limit never reads as the limit)."""
    for unit, size in _BINARY_UNITS:
        if num_bytes >= size:
            if num_bytes % size == 0:
                return f"{num_bytes // size} {unit}"
            thousandths = num_bytes * 1000 // size
            return f"{thousandths // 1000}.{thousandths % 1000:03d} {unit}"
    return f"{num_bytes} B"


def size_at_least(num_bytes: int) -> str:
    """The shortest size a user would type that is >= ``num_bytes``, whole MiB (or KiB, or
    bytes, below those): 188743680 -> '180MiB', 16384 -> '16KiB'. ``parse_bytes`` reads it."""
    for unit, size in _BINARY_UNITS[2:]:
        if num_bytes >= size:
            return f"{-(-num_bytes // size)}{unit}"
    return f"{num_bytes}"


def parse_tokens(option: str, text: str) -> int:
    """'6144' -> 6144; '32k' -> 32768 (k = 1024 tokens, as '32k context' is usually meant)."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([kK]?)\s*", text, re.ASCII)
    if match is None:
        raise UsageError(
            f"{option}: expected a whole number of tokens (or e.g. 32k), got {text!r}", option
        )
    if len(match.group(1)) > 20:
        raise UsageError(f"{option}: {text!r} is more than {MAX_TOKENS} tokens", option)
    value = int(match.group(1)) * (1024 if match.group(2) else 1)
    if value > MAX_TOKENS:
        raise UsageError(f"{option}: {text!r} is more than {MAX_TOKENS} tokens", option)
    return value


def parse_count(option: str, text: str) -> int:
    """A whole number of things (sequences, hits): '128' -> 128 (ASCII digits only)."""
    stripped = text.strip()
    if not re.fullmatch(r"[0-9]+", stripped, re.ASCII):
        raise UsageError(
            f"{option}: expected a whole number written with digits 0-9, got {text!r}", option
        )
    if len(stripped) > 20 or int(stripped) > MAX_COUNT:
        raise UsageError(f"{option}: {text!r} is more than {MAX_COUNT}", option)
    return int(stripped)


def parse_int_list(option: str, text: str) -> tuple[int, ...]:
    """'8,16,32' -> (8, 16, 32): ASCII integers, each at most ``MAX_TOKENS``."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not all(re.fullmatch(r"[+-]?[0-9]{1,20}", part, re.ASCII) for part in parts):
        raise UsageError(f"{option}: expected comma-separated integers, got {text!r}", option)
    values = tuple(int(part) for part in parts)
    if not values:
        raise UsageError(f"{option}: give at least one value", option)
    if any(abs(v) > MAX_TOKENS for v in values):
        raise UsageError(f"{option}: values must be at most {MAX_TOKENS}, got {text!r}", option)
    return values


def parse_unit_list(option: str, text: str | None) -> tuple[int | None, ...]:
    """``U[,U]``: whole numbers of tokens >= 1, or ``B`` (None: whole blocks); () for None."""
    if text is None:
        return ()
    units: list[int | None] = []
    for part in (p.strip() for p in text.split(",")):
        if part.upper() == "B":
            units.append(None)
        elif part.isdecimal() and int(part) >= 1:
            units.append(int(part))
        else:
            raise UsageError(f"{option}: expected whole numbers >= 1 or B, got {text!r}", option)
    return tuple(units)


def parse_number(option: str, text: str, *, minimum: float | None = None) -> float:
    """A finite real number: '0.9' -> 0.9. ``nan`` and ``inf`` are refused (a NaN compares
    false with every bound, so it would slip past a range check and hang a loop later)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UsageError(f"{option}: expected a number, got {text!r}", option) from None
    if not math.isfinite(value):
        raise UsageError(f"{option}: must be a finite number, got {text!r}", option)
    if minimum is not None and value < minimum:
        raise UsageError(f"{option}: must be >= {minimum:g}, got {text!r}", option)
    return value


def check_block_size(block_size: object, param: str = "block_size") -> int:
    """The one rule for a block size: an integer number of tokens, at least 1 (any B >= 1 is a
    valid page; backends narrow it further in ``planner.constraints``). Returns it, or raises
    ``UsageError`` naming ``param``."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise UsageError(f"{param} must be an integer >= 1 token, got {block_size!r}", param)
    return block_size
