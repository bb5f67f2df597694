"""The P/D handshake record read from a shared store is untrusted input (issue 27): a record a
third party wrote (``redis-cli SET pagedkv:pd:<group>:prefill ...``) with a huge number, deep
nesting, a wrong type or too many bytes is a one-line ``UsageError`` naming the field, never an
``OverflowError``, a ``RecursionError`` or a record of the wrong types."""

from __future__ import annotations

import json

import pytest

from pagedkv.disagg.handshake import Handshake, PeerRecord, record_key
from pagedkv.errors import UsageError
from tests.disagg.test_handshake import DictClient, rec

GOOD = json.loads(rec("prefill").to_json())


def _with(path: str, value) -> str:
    data = json.loads(json.dumps(GOOD))
    *parents, key = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    node[key] = value
    return json.dumps(data)


HOSTILE = {
    "block_size 1e400": (_with("page_format.block_size", 1).replace(": 1,", ": 1e400,", 1),
                         "does not fit a float"),
    "30k nested [": ("[" * 30_000 + "]" * 30_000, "nests 30000 levels deep"),
    "block_size a string": (_with("page_format.block_size", "16"),
                            "page_format.block_size must be an integer"),
    "kv_dtype a number": (_with("page_format.kv_dtype", 4), "page_format.kv_dtype must be a string"),
    "pid a bool": (_with("pid", True), "pid must be an integer"),
    "pid negative": (_with("pid", -1), "pid must be in"),
    "model too long": (_with("model", "m" * 2000), "model is 2000 characters"),
    "an extra page field": (_with("page_format.extra", 1), "page format keys differ"),
    "no role": (json.dumps({k: v for k, v in GOOD.items() if k != "role"}), "role is missing"),
    "too many bytes": (_with("host", "h" * 70_000), "bytes, over"),
    "NaN": (_with("pid", 1).replace('"pid": 1', '"pid": NaN'), "NaN"),
}  # fmt: skip


def test_the_good_record_round_trips():
    assert PeerRecord.from_json(json.dumps(GOOD)) == rec("prefill")


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_record_is_a_usage_error_naming_the_field(name):
    text, words = HOSTILE[name]
    client = DictClient()
    client.data[record_key("g", "prefill")] = text.encode()
    with pytest.raises(UsageError, match="not a pagedkv page-format record") as err:
        Handshake(client, "redis://x", "g").wait_for("prefill", 1.0)
    assert words in str(err.value) and "\n" not in str(err.value)
