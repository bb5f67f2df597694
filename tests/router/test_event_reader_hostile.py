"""The router's KV event reader against a third party writing to a replica's stream (issue 27),
on a real redis-server: each bad entry (``block_size`` 1e400, 100k nested ``[``, 300k hashes,
wrong types, not JSON, no ``batch`` field, the largest stream ID) is skipped, counted by kind,
logged once per kind, and the reader goes on: a well-formed entry written afterwards is
delivered. A stream reset (deleted and written anew) is noticed and read from its start."""

from __future__ import annotations

import json
import logging
import time

import pytest
import redis

from pagedkv.kvcache.events import AllBlocksCleared, BlockStored, KVEventBatch
from pagedkv.router.event_reader import KVEventReader
from pagedkv.router.handshake import ReplicaInfo
from pagedkv.router.metrics import RouterMetrics
from pagedkv.router.replicas import IndexFeed, ReplicaState
from tests.kvstore.redis_server import RedisServer
from tests.router.fakes import info_json

STREAM = "pagedkv:kv-events:hostile"
MAX_ID = "18446744073709551615-18446744073709551615"
H = "ab" * 32


def _stored(**fields) -> str:
    event = {"type": "BlockStored", "block_hashes": [H], "parent_block_hash": None,
             "block_size": 16, **fields}  # fmt: skip
    return json.dumps({"ts": 1.0, "events": [event]})


# what a third party XADDs -> the kind the reader counts it as
BAD_ENTRIES: list[tuple[dict, str]] = [
    ({"batch": _stored(block_size=1).replace('"block_size": 1', '"block_size": 1e400')},
     "not_json"),
    ({"batch": "[" * 100_000 + "]" * 100_000}, "too_deep"),
    ({"batch": _stored(block_hashes=["0a"] * 300_000)}, "too_many_hashes"),
    ({"batch": _stored(block_hashes=[H] * 300_000)}, "too_large"),  # 20 MB
    ({"batch": _stored(block_size="16")}, "bad_field"),
    ({"batch": '{"ts": 1, "events": [{"type": [1]}]}'}, "bad_field"),
    ({"batch": "{not json"}, "not_json"),
    ({"batch": b"\xff\xfe\x00"}, "not_json"),
    ({"other": "field"}, "no_batch_field"),
]  # fmt: skip
assert "1e400" in BAD_ENTRIES[0][0]["batch"]


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path).start()
    yield s
    s.stop()


def _wait(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _good(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), (BlockStored((i.to_bytes(32, "big"),), None, 16),))


def test_every_bad_entry_is_skipped_counted_and_the_reader_goes_on(server, caplog):
    client = redis.Redis.from_url(server.url)
    got: list[KVEventBatch] = []
    reader = KVEventReader(server.url, STREAM, got.append, block_ms=20)
    with caplog.at_level(logging.WARNING, logger="pagedkv.router"):
        reader.start()
        try:
            for i, (fields, _) in enumerate(BAD_ENTRIES * 2):  # each kind twice
                client.xadd(STREAM, fields)
                client.xadd(STREAM, {"batch": _good(i).to_json()})
                _wait(lambda i=i: len(got) == i + 1)  # the next good entry arrives
                assert reader._thread.is_alive()
            assert got == [_good(i) for i in range(2 * len(BAD_ENTRIES))]
            kinds: dict[str, int] = {}
            for _, kind in BAD_ENTRIES * 2:
                kinds[kind] = kinds.get(kind, 0) + 1
            assert reader.malformed_by_kind == kinds
            assert reader.num_malformed == 2 * len(BAD_ENTRIES) and reader.connected
        finally:
            reader.stop()
            client.close()
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == len(kinds)  # once per kind, not per entry


def test_the_largest_id_then_a_reset_stream_is_read_from_its_start(server):
    """A third party's entry at the largest ID ends every later ``XADD *``: the publisher
    deletes the stream and writes a snapshot into a fresh one, whose ids are all below the
    reader's last id. The reader notices and reads the new stream from its start."""
    client = redis.Redis.from_url(server.url)
    got: list[KVEventBatch] = []
    reader = KVEventReader(server.url, STREAM, got.append, block_ms=20).start()
    try:
        client.xadd(STREAM, {"batch": _good(1).to_json()})
        client.xadd(STREAM, {"batch": "x"}, id=MAX_ID)
        _wait(lambda: reader.last_id == MAX_ID and reader.num_malformed == 1)
        with pytest.raises(redis.ResponseError, match="exhausted the last possible ID"):
            client.xadd(STREAM, {"batch": _good(2).to_json()})
        client.delete(STREAM)  # what the publisher does; then its snapshot
        snapshot = KVEventBatch(2.0, (AllBlocksCleared(), *_good(2).events))
        client.xadd(STREAM, {"batch": snapshot.to_json()})
        _wait(lambda: len(got) == 2)
        assert got == [_good(1), snapshot] and reader.num_resets == 1
        client.xadd(STREAM, {"batch": _good(3).to_json()})
        _wait(lambda: len(got) == 3)
        assert got[2] == _good(3) and reader.num_resets == 1  # no reset while it progresses
        # A stream rewritten with smaller explicit ids: a reset too.
        client.delete(STREAM)
        client.xadd(STREAM, {"batch": _good(4).to_json()}, id="1-1")
        _wait(lambda: len(got) == 4)
        assert got[3] == _good(4) and reader.num_resets == 2
    finally:
        reader.stop()
        client.close()


def test_the_router_exports_what_its_readers_skipped_and_reset(server):
    url = "http://replica:1"
    replica = ReplicaState(url, ReplicaInfo.from_json(url, info_json("one")))

    def factory(redis_url, stream, on_batch):
        return KVEventReader(redis_url, stream, on_batch, block_ms=20)

    feed = IndexFeed(factory)
    metrics = RouterMetrics([replica], feed, "prefix")
    client = redis.Redis.from_url(server.url)
    feed.follow(url, server.url, STREAM)
    try:
        client.xadd(STREAM, {"batch": "[" * 100_000})
        client.xadd(STREAM, {"batch": _good(1).to_json()})
        _wait(lambda: feed.num_blocks(url) == 1)
        text = metrics.render().decode()
        assert f'pagedkv_router_kv_event_malformed_total{{replica="{url}"}} 1.0' in text
        assert f'pagedkv_router_kv_event_stream_resets_total{{replica="{url}"}} 0.0' in text
        assert f'pagedkv_router_index_evicted_blocks_total{{replica="{url}"}} 0.0' in text
    finally:
        for reader in feed.readers():
            reader.stop()
        client.close()
