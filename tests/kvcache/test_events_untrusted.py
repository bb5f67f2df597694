"""``KVEventBatch.from_json`` on entries a third party wrote to a stream (issue 27): every one is
an ``UntrustedInput`` (a ``ValueError``) with a kind and the field named, never an
``OverflowError``, a ``RecursionError`` or a ``TypeError``."""

from __future__ import annotations

import json

import pytest

from pagedkv.kvcache.events import (
    MAX_ENTRY_BYTES,
    MAX_HASHES_PER_ENTRY,
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
)
from pagedkv.untrusted import UntrustedInput

H = "ab" * 32
GOOD = KVEventBatch(1.0, (AllBlocksCleared(), BlockStored((bytes.fromhex(H),), None, 16)))
GOOD_JSON = GOOD.to_json()


def stored(**fields) -> str:
    event = {"type": "BlockStored", "block_hashes": [H], "parent_block_hash": None,
             "block_size": 16, **fields}  # fmt: skip
    return json.dumps({"ts": 1.0, "events": [event]})


# name -> (entry text, the refusal's kind, words the message holds)
HOSTILE = {
    "block_size 1e400": (
        GOOD_JSON.replace('"block_size":16', '"block_size":1e400'),
        "not_json",
        "1e400",
    ),
    "block_size NaN": (GOOD_JSON.replace('"block_size":16', '"block_size":NaN'), "not_json", "NaN"),
    "100k nested [": ("[" * 100_000 + "]" * 100_000, "too_deep", "100000 levels"),
    "300k short hashes": (stored(block_hashes=["0a"] * 300_000), "too_many_hashes", "16384"),
    "20 MB of hashes": (stored(block_hashes=[H] * 300_000), "too_large", "bytes"),
    "block_size a string": (stored(block_size="16"), "bad_field", "events[0].block_size"),
    "block_size 0": (stored(block_size=0), "bad_field", "events[0].block_size"),
    "block_size true": (stored(block_size=True), "bad_field", "events[0].block_size"),
    "ts a list": (GOOD_JSON.replace('"ts":1.0', '"ts":[1]'), "bad_field", "ts"),
    "a hash an int": (stored(block_hashes=[7]), "bad_field", "events[0].block_hashes[0]"),
    "a hash with spaces": (stored(block_hashes=["ab cd"]), "bad_field", "block_hashes[0]"),
    "a hash too long": (stored(block_hashes=["ab" * 65]), "bad_field", "block_hashes[0]"),
    "no hashes list": (stored(block_hashes={"a": 1}), "bad_field", "events[0].block_hashes"),
    "events an object": ('{"ts": 1, "events": {}}', "bad_field", "events"),
    "an event a string": ('{"ts": 1, "events": ["x"]}', "bad_field", "events[0]"),
    "type a list": ('{"ts": 1, "events": [{"type": [1]}]}', "bad_field", "events[0].type"),
    "unknown type": ('{"ts": 1, "events": [{"type": "Nope"}]}', "bad_field", "Nope"),
    "medium a number": (stored(medium=3), "bad_field", "events[0].medium"),
    "lora_id too long": (stored(lora_id="x" * 300), "too_large", "events[0].lora_id"),
    "parent an object": (stored(parent_block_hash={}), "bad_field", "parent_block_hash"),
    "not JSON": ("x", "not_json", "not JSON"),
    "not UTF-8": (b"\xff\xfe{}", "not_json", "UTF-8"),
    "a list": ("[1]", "bad_field", "must be an object"),
    "over the byte cap": (" " * (MAX_ENTRY_BYTES + 1), "too_large", "bytes"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_every_hostile_entry_is_one_named_refusal(name):
    text, kind, words = HOSTILE[name]
    with pytest.raises(UntrustedInput, match="not a pagedkv KV event batch") as err:
        KVEventBatch.from_json(text)
    assert err.value.kind == kind and words in str(err.value), str(err.value)


def test_an_entry_at_the_hash_cap_is_taken():
    text = stored(block_hashes=[f"{i:04x}" for i in range(MAX_HASHES_PER_ENTRY)])
    assert len(KVEventBatch.from_json(text).events[0].block_hashes) == MAX_HASHES_PER_ENTRY
