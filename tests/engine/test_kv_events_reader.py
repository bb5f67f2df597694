"""``KVEventReader`` against a real redis-server: order, malformed entries, outages, stop."""

from __future__ import annotations

import time

import pytest
import redis

from pagedkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagedkv.router.event_reader import KVEventReader
from tests.kvstore.redis_server import RedisServer

STREAM = "pagedkv:kv-events:test"


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path).start()
    yield s
    s.stop()


def _wait(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _batch(i: int) -> KVEventBatch:
    h = i.to_bytes(32, "big")
    return KVEventBatch(float(i), (BlockStored((h,), None, 16), BlockRemoved((h,))))


def test_reads_in_order_skips_and_counts_malformed(server):
    client = redis.Redis.from_url(server.url)
    client.xadd(STREAM, {"batch": KVEventBatch(0.0, (AllBlocksCleared(),)).to_json()})
    client.xadd(STREAM, {"batch": "{not json"})
    client.xadd(STREAM, {"other": "field"})
    client.xadd(STREAM, {"batch": _batch(1).to_json()})
    got: list[KVEventBatch] = []
    reader = KVEventReader(server.url, STREAM, got.append, block_ms=50).start()
    try:
        _wait(lambda: len(got) == 2)
        client.xadd(STREAM, {"batch": _batch(2).to_json()})  # arrives while it blocks
        _wait(lambda: len(got) == 3)
        assert got == [KVEventBatch(0.0, (AllBlocksCleared(),)), _batch(1), _batch(2)]
        assert reader.num_batches == 3 and reader.num_malformed == 2 and reader.connected
    finally:
        reader.stop()  # waits one XREAD plus 3 s at most
        assert not reader._thread.is_alive()  # the thread saw the stop and ended
    client.close()


def test_outage_then_resume_after_last_id(server):
    client = redis.Redis.from_url(server.url)
    got: list[KVEventBatch] = []
    reader = KVEventReader(server.url, STREAM, got.append, block_ms=50).start()
    try:
        client.xadd(STREAM, {"batch": _batch(1).to_json()})
        _wait(lambda: len(got) == 1)
        server.stop()
        _wait(lambda: not reader.connected)
        assert reader.last_error
        server.start()  # same port, empty (no persistence): a fresh stream with new ids
        client.xadd(STREAM, {"batch": _batch(2).to_json()}, id="9999999999999-0")
        _wait(lambda: len(got) == 2, timeout_s=10)
        assert got[1] == _batch(2) and reader.connected
    finally:
        reader.stop()
        client.close()


def test_reader_of_a_down_redis_stops_promptly(tmp_path):
    """``stop`` wakes a reader out of its back-off: with a back-off of a minute, the thread
    ends within ``stop``'s own wait (a few seconds), however slow the machine is."""
    from pagedkv.kvstore.redis_policy import RedisPolicy
    from tests.kvstore.redis_server import free_port

    policy = RedisPolicy(first_backoff_s=60.0, max_backoff_s=60.0)
    url = f"redis://127.0.0.1:{free_port()}"
    reader = KVEventReader(url, STREAM, print, block_ms=50, policy=policy)
    reader.start()
    _wait(lambda: reader.last_error is not None)
    assert not reader.connected and reader.num_batches == 0
    reader.stop()
    assert not reader._thread.is_alive()


def test_start_at_dollar_reads_only_new_entries_and_misses_none(server):
    client = redis.Redis.from_url(server.url)
    client.xadd(STREAM, {"batch": _batch(1).to_json()})
    got: list[KVEventBatch] = []
    reader = KVEventReader(server.url, STREAM, got.append, start_id="$", block_ms=10).start()
    try:
        _wait(lambda: reader.connected)
        for i in range(2, 6):  # some land between two XREADs
            client.xadd(STREAM, {"batch": _batch(i).to_json()})
            time.sleep(0.015)
        _wait(lambda: len(got) == 4)
        assert got == [_batch(i) for i in range(2, 6)]
    finally:
        reader.stop()
        client.close()
