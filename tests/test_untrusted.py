"""``pagedkv.untrusted`` against hand-written inputs: what a peer or Redis may send, and the one
exception (``UntrustedInput``, a ``ValueError``) naming the field for everything refused."""

from __future__ import annotations

import sys

import pytest

from pagedkv import untrusted as u


def refused(expected_kind: str, call, *args, **kwargs) -> str:
    with pytest.raises(u.UntrustedInput) as err:
        call(*args, **kwargs)
    assert err.value.kind == expected_kind, err.value
    assert isinstance(err.value, ValueError)
    return str(err.value)


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ("[]", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('["[[[[", "]]]]"]', 1),  # brackets inside strings are text
        ('["\\"[[[", "x"]', 1),  # an escaped quote does not end the string
        ('["\\\\", [[]]]', 3),  # an escaped backslash does not escape the quote after it
        ('"[[[', 0),  # a string that never ends: the rest is string
        ("[" * 10 + "]" * 10, 10),
    ],
)
def test_nesting_depth_skips_strings(text, depth):
    assert u.nesting_depth(text) == depth


def test_deep_nesting_never_reaches_the_parser(monkeypatch):
    import json

    def parser_called(*args, **kwargs):
        raise AssertionError("json.loads must not see it")

    monkeypatch.setattr(json, "loads", parser_called)
    text = "[" * 100_000 + "]" * 100_000
    msg = refused(u.TOO_DEEP, u.parse_json, text, max_bytes=1 << 20, what="the entry")
    assert "the entry nests 100000 levels deep, over 32" in msg
    # a string's ']' cannot hide the nesting: '"]]]]"' first, then the brackets
    hidden = '["' + "]" * 100_000 + '", ' + "[" * 1000 + "]" * 1000 + "]"
    refused(u.TOO_DEEP, u.parse_json, hidden, max_bytes=1 << 20)
    assert sys.getrecursionlimit() < 100_000  # what a recursive parse would have hit


def test_depth_scan_is_linear_on_escapes_and_unterminated_strings():
    # A quadratic scan (each quote retried to the end) would take minutes on these.
    for text in ('"' + '\\"' * 1_000_000, '"' + '\\"' * 1_000_000 + "\\", '"a",' * 500_000):
        assert u.nesting_depth(text) == 0


@pytest.mark.parametrize(
    "text", ["NaN", "[Infinity]", '{"x": -Infinity}', "1e400", "[-1e999]", "9" * 41]
)
def test_non_finite_and_overlong_numbers_are_refused(text):
    msg = refused(u.NOT_JSON, u.parse_json, text, max_bytes=100, what="the answer")
    assert msg.startswith("the answer")


def test_size_is_bytes_and_checked_first():
    assert u.parse_json('"' + "x" * 98 + '"', max_bytes=100) == "x" * 98
    refused(u.TOO_LARGE, u.parse_json, '"' + "x" * 99 + '"', max_bytes=100)
    refused(u.TOO_LARGE, u.parse_json, '"' + "é" * 50 + '"', max_bytes=100)  # 102 UTF-8 bytes
    refused(u.TOO_LARGE, u.parse_json, b"[" * 101, max_bytes=100)  # before the depth scan
    assert u.parse_json(b"[1.5, 2]", max_bytes=100) == [1.5, 2]


@pytest.mark.parametrize("data", ["", "{not json", "[1,]", b"\xff\xfe", "[1] [2]"])
def test_not_json(data):
    refused(u.NOT_JSON, u.parse_json, data, max_bytes=100)


def test_getters_check_type_and_range_and_name_the_field():
    d = {"n": 16, "f": 2.5, "b": True, "s": "abc", "l": [1, 2, 3], "o": {}, "z": None}
    assert u.get_int(d, "n", lo=1, hi=16) == 16
    assert u.get_float(d, "n", lo=0, hi=20) == 16.0  # an integer is a number too
    assert u.get_float(d, "f", lo=0, hi=3) == 2.5
    assert u.get_bool(d, "b") is True
    assert u.get_str(d, "s", max_len=3) == "abc"
    assert u.get_list(d, "l", max_len=3) == [1, 2, 3]
    assert u.get_object(d, "o") == {}
    assert u.get_optional_str(d, "z", max_len=1) is None
    assert u.get_optional_str(d, "absent", max_len=1) is None
    assert "events[2].n must be in [1, 15], got 16" in refused(
        u.BAD_FIELD, u.get_int, d, "n", lo=1, hi=15, at="events[2]"
    )
    assert "b must be an integer" in refused(u.BAD_FIELD, u.get_int, d, "b", lo=0, hi=1)
    assert "f must be an integer" in refused(u.BAD_FIELD, u.get_int, d, "f", lo=0, hi=9)
    assert "s must be a number" in refused(u.BAD_FIELD, u.get_float, d, "s", lo=0, hi=1)
    assert "b must be a number" in refused(u.BAD_FIELD, u.get_float, d, "b", lo=0, hi=1)
    assert "n must be a string" in refused(u.BAD_FIELD, u.get_str, d, "n", max_len=9)
    assert "s is 3 characters, over 2" in refused(u.TOO_LARGE, u.get_str, d, "s", max_len=2)
    assert "l has 3 items, over 2" in refused(u.TOO_LARGE, u.get_list, d, "l", max_len=2)
    assert "o must be a list" in refused(u.BAD_FIELD, u.get_list, d, "o", max_len=2)
    assert "n must be true or false" in refused(u.BAD_FIELD, u.get_bool, d, "n")
    assert "x.missing is missing" in refused(u.BAD_FIELD, u.get_int, d, "missing", lo=0,
                                             hi=1, at="x")  # fmt: skip
    assert "l must be an object" in refused(u.BAD_FIELD, u.get_object, d, "l")
    refused("too_many_hashes", u.get_list, d, "l", max_len=1, kind="too_many_hashes")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 10**400, 1e300])
def test_as_float_refuses_what_is_not_a_finite_number_in_range(value):
    msg = refused(u.BAD_FIELD, u.as_float, value, "ts", lo=0.0, hi=1e15)
    assert msg.startswith("ts must be")


def test_a_long_value_is_shortened_in_the_message():
    msg = refused(u.BAD_FIELD, u.as_int, "x" * 10_000, "n", lo=0, hi=1)
    assert len(msg) < 100
