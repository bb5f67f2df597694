"""The payload format: round trip, and every kind of bad payload rejected with its reason."""

from __future__ import annotations

import pytest

from pagedkv.errors import UsageError
from pagedkv.kvstore import parse_store_url
from pagedkv.kvstore.codec import Rejected, decode_payload, encode_payload, store_key
from pagedkv.kvstore.namespace import store_namespace
from pagedkv.pages.page_format import PageFormat

FMT = PageFormat(16, "mha", "fp32", 2, 2, 16, 0, 0, 512)
NS = store_namespace(FMT, "model-a", "sha256")
H = bytes(range(32))
BODY = bytes(range(256)) * 32


def test_round_trip_returns_the_body():
    payload = encode_payload(NS, H, BODY)
    assert bytes(decode_payload(payload, NS, H, len(BODY))) == BODY


def test_key_names_namespace_and_hash():
    assert store_key(NS, H) == f"pagedkv:kv:{NS.hex()}:{H.hex()}".encode()


def test_namespace_depends_on_format_model_and_hash_function():
    other_fmt = PageFormat(32, "mha", "fp32", 2, 2, 16, 0, 0, 512)
    assert len({NS, store_namespace(other_fmt, "model-a", "sha256"),
                store_namespace(FMT, "model-b", "sha256"),
                store_namespace(FMT, "model-a", "blake2b")}) == 4  # fmt: skip


def reason(payload: bytes, ns: bytes = NS, h: bytes = H, n: int = len(BODY)) -> str:
    out = decode_payload(payload, ns, h, n)
    assert isinstance(out, Rejected), "a bad payload was accepted"
    return out.reason


@pytest.mark.parametrize("index", [0, 7, 30, 60, 100, -1])
def test_one_flipped_byte_is_rejected(index):
    payload = bytearray(encode_payload(NS, H, BODY))
    payload[index] ^= 0x01
    assert reason(bytes(payload)) in {
        "bad_magic", "bad_version", "foreign_format", "wrong_hash", "bad_length",
        "bad_checksum", "truncated",
    }  # fmt: skip


def test_each_reason():
    good = encode_payload(NS, H, BODY)
    assert reason(good[:5]) == "truncated"
    assert reason(good[:-1]) == "truncated"
    assert reason(good[:40]) == "truncated"
    assert reason(b"XXXXXX" + good[6:]) == "bad_magic"
    assert reason(good[:6] + b"\x09\x00" + good[8:]) == "bad_version"
    other_ns = store_namespace(FMT, "model-b", "sha256")
    assert reason(encode_payload(other_ns, H, BODY)) == "foreign_format"
    assert reason(encode_payload(NS, bytes(32), BODY)) == "wrong_hash"
    assert reason(good, n=len(BODY) * 2) == "bad_length"
    flipped = bytearray(good)
    flipped[-1] ^= 0x80
    assert reason(bytes(flipped)) == "bad_checksum"


def test_garbage_never_raises():
    for junk in (b"", b"\x00" * 3, b"PKVBLK", b"PKVBLK\x01\x00" + b"\xff" * 100):
        assert isinstance(decode_payload(junk, NS, H, 10), Rejected)


def test_store_url_is_checked_at_the_edge():
    a = parse_store_url("redis://127.0.0.1:6380")
    assert (a.host, a.port, a.db) == ("127.0.0.1", 6380, 0)
    assert parse_store_url("redis://cache/2").port == 6379
    for bad in ("127.0.0.1:6379", "http://h:1", "redis://", "redis://h:x", "redis://h:99999",
                "redis://u:p@h:1", "redis://h:1/db", "redis://h:1?x=1"):  # fmt: skip
        with pytest.raises(UsageError) as info:
            parse_store_url(bad)
        assert "\n" not in str(info.value) and info.value.param == "kv_store"


def test_a_malformed_kv_store_flag_is_one_line(capsys):
    from pagedkv import cli

    assert cli.main(["generate", "--kv-store", "redis:/nowhere", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv generate: error: --kv-store must be redis://HOST:PORT")
    assert err.count("\n") == 1
