"""Reading JSON that a peer or Redis sent: bounded, validated, one exception type.

docs/architecture.md's rule 7: every byte from a peer (a replica's ``/pagedkv/info``, a P/D handshake
record) or from Redis (a KV event entry) is untrusted. ``parse_json`` refuses, before
``json.loads`` sees the text:

* more than ``max_bytes`` bytes (UTF-8);
* nesting deeper than ``max_depth``, found by a linear scan (``json.loads`` recurses once per
  level: 100k ``[`` would end in ``RecursionError`` instead of a clean refusal);

and while parsing, ``NaN``, ``Infinity``, ``-Infinity`` and numbers that overflow a float
(``1e400``), which Python's json accepts and no writer of ours sends. The getters then check
each field's type and range, so a caller's own code never meets ``int(1e400)``
(``OverflowError``) or a list of a million entries. Every refusal is an ``UntrustedInput``
(a ``ValueError``) naming the field, with a ``kind`` a reader can count and log once by.

This module imports nothing of pagedkv: any layer may use it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping
from typing import Any

DEFAULT_MAX_DEPTH = 32  # no message of ours nests beyond 5 levels
MAX_INT_DIGITS = 40  # a JSON integer longer than this is no count, size or id of ours

# The kinds of refusal (``UntrustedInput.kind``).
TOO_LARGE = "too_large"  # the text, or a list or string in it, is over its bound
TOO_DEEP = "too_deep"
NOT_JSON = "not_json"  # includes NaN / Infinity / non-finite numbers
BAD_FIELD = "bad_field"  # missing, of the wrong type, or out of range


class UntrustedInput(ValueError):
    """Input from a peer or Redis that is not what it must be; ``kind``: one of the kinds
    above (or a caller's own, e.g. ``"too_many_hashes"``)."""

    def __init__(self, message: str, kind: str = BAD_FIELD) -> None:
        super().__init__(message)
        self.kind = kind


# Escapes first (a ``\"`` inside a string must not end it), then strings: each pattern is a
# plain character run, so the scan is linear whatever the text. A backslash outside a string
# is invalid JSON, where json.loads stops before nesting any deeper than the scan saw.
_ESCAPE = re.compile(r"\\.", re.DOTALL)
_STRING = re.compile(r'"[^"]*(?:"|\Z)')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def nesting_depth(text: str) -> int:
    """The deepest ``[``/``{`` nesting of ``text``, brackets inside strings left out; linear
    in ``len(text)`` and without recursion, so it is safe on any input."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", _ESCAPE.sub("", text)))
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _refuse_constant(name: str) -> Any:
    raise UntrustedInput(f"{name} is not a number JSON allows", NOT_JSON)


def _bounded_int(text: str) -> int:
    # Python >= 3.11 refuses past 4,300 digits itself; the bound holds on 3.10 too.
    if len(text) > MAX_INT_DIGITS:
        raise UntrustedInput(f"an integer of {len(text)} digits", NOT_JSON)
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UntrustedInput(f"the number {text[:40]} does not fit a float", NOT_JSON)
    return value


def parse_json(
    data: str | bytes,
    *,
    max_bytes: int,
    max_depth: int = DEFAULT_MAX_DEPTH,
    what: str = "the input",
) -> Any:
    """The JSON value of ``data`` (UTF-8 when bytes), or ``UntrustedInput`` naming ``what``:
    over ``max_bytes``, nested deeper than ``max_depth``, not JSON, or holding a number that
    is not finite. Mutates nothing; the result is the caller's."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) > max_bytes:
            raise UntrustedInput(f"{what} is {len(data)} bytes, over {max_bytes}", TOO_LARGE)
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UntrustedInput(f"{what} is not UTF-8 ({exc.reason})", NOT_JSON) from None
    else:
        text = data
        # A str is never longer in characters than in UTF-8 bytes: the cheap test first.
        if len(text) > max_bytes or (
            not text.isascii() and len(text.encode("utf-8", "surrogatepass")) > max_bytes
        ):
            raise UntrustedInput(f"{what} is over {max_bytes} bytes", TOO_LARGE)
    depth = nesting_depth(text)
    if depth > max_depth:
        raise UntrustedInput(f"{what} nests {depth} levels deep, over {max_depth}", TOO_DEEP)
    try:
        return json.loads(
            text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int
        )
    except UntrustedInput as exc:
        raise UntrustedInput(f"{what}: {exc}", exc.kind) from None
    except (ValueError, RecursionError) as exc:  # RecursionError: never, after the depth scan
        raise UntrustedInput(f"{what} is not JSON ({str(exc)[:100]})", NOT_JSON) from None


# -- typed getters: ``name`` is the field's path in messages ("events[3].block_size") ------


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def as_object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UntrustedInput(f"{name} must be an object, got {type(value).__name__}")
    return value


def as_int(value: Any, name: str, *, lo: int, hi: int) -> int:
    """A JSON integer (not a bool, not ``16.0``) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UntrustedInput(f"{name} must be an integer, got {_shown(value)}")
    if not lo <= value <= hi:
        raise UntrustedInput(f"{name} must be in [{lo}, {hi}], got {_shown(value)}")
    return value


def as_float(value: Any, name: str, *, lo: float, hi: float) -> float:
    """A finite number (an integer is taken too) in ``[lo, hi]``, as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UntrustedInput(f"{name} must be a number, got {_shown(value)}")
    if isinstance(value, int) and not -(2**1023) < value < 2**1023:  # float(10**400) raises
        raise UntrustedInput(f"{name} must be in [{lo:g}, {hi:g}], got {_shown(value)}")
    number = float(value)
    if not (math.isfinite(number) and lo <= number <= hi):
        raise UntrustedInput(
            f"{name} must be a finite number in [{lo:g}, {hi:g}], got {_shown(value)}"
        )
    return number


def as_str(value: Any, name: str, *, max_len: int) -> str:
    if not isinstance(value, str):
        raise UntrustedInput(f"{name} must be a string, got {_shown(value)}")
    if len(value) > max_len:
        raise UntrustedInput(f"{name} is {len(value)} characters, over {max_len}", TOO_LARGE)
    return value


def as_list(value: Any, name: str, *, max_len: int, kind: str = TOO_LARGE) -> list[Any]:
    """A list of at most ``max_len`` items (``kind``: the kind of the refusal past it)."""
    if not isinstance(value, list):
        raise UntrustedInput(f"{name} must be a list, got {type(value).__name__}")
    if len(value) > max_len:
        raise UntrustedInput(f"{name} has {len(value)} items, over {max_len}", kind)
    return value


def as_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise UntrustedInput(f"{name} must be true or false, got {_shown(value)}")
    return value


def field(obj: Mapping[str, Any], key: str, at: str = "") -> Any:
    """``obj[key]``, or ``UntrustedInput`` naming ``at.key`` when it is missing."""
    if key not in obj:
        raise UntrustedInput(f"{path(at, key)} is missing")
    return obj[key]


def path(at: str, key: str) -> str:
    return f"{at}.{key}" if at else key


def get_object(obj: Mapping[str, Any], key: str, at: str = "") -> dict[str, Any]:
    return as_object(field(obj, key, at), path(at, key))


def get_int(obj: Mapping[str, Any], key: str, *, lo: int, hi: int, at: str = "") -> int:
    return as_int(field(obj, key, at), path(at, key), lo=lo, hi=hi)


def get_float(obj: Mapping[str, Any], key: str, *, lo: float, hi: float, at: str = "") -> float:
    return as_float(field(obj, key, at), path(at, key), lo=lo, hi=hi)


def get_str(obj: Mapping[str, Any], key: str, *, max_len: int, at: str = "") -> str:
    return as_str(field(obj, key, at), path(at, key), max_len=max_len)


def get_optional_str(obj: Mapping[str, Any], key: str, *, max_len: int, at: str = "") -> str | None:
    """``obj[key]`` as a bounded string; None when it is missing or null."""
    value = obj.get(key)
    return None if value is None else as_str(value, path(at, key), max_len=max_len)


def get_list(
    obj: Mapping[str, Any], key: str, *, max_len: int, at: str = "", kind: str = TOO_LARGE
) -> list[Any]:
    return as_list(field(obj, key, at), path(at, key), max_len=max_len, kind=kind)


def get_bool(obj: Mapping[str, Any], key: str, at: str = "") -> bool:
    return as_bool(field(obj, key, at), path(at, key))
