"""``KVEventPublisher`` against a stream a third party spoiled (issue 27), on a real
redis-server: after an entry at the largest ID (every ``XADD *`` then fails) or a key of
another type, the publisher deletes its stream, asks for a snapshot and publishes again; a key
spoiled again right after a reset is backed off from like an outage. A batch over the readers'
caps goes out as several entries, each one a reader takes."""

from __future__ import annotations

import time

import pytest
import redis

from pagedkv.kvcache.events import MAX_HASHES_PER_ENTRY, AllBlocksCleared, BlockStored, KVEventBatch
from pagedkv.kvstore.address import parse_store_url
from pagedkv.kvstore.event_publisher import KVEventPublisher
from pagedkv.kvstore.redis_policy import RedisPolicy

STREAM = "pagedkv:kv-events:spoiled"
MAX_ID = "18446744073709551615-18446744073709551615"
FAST = RedisPolicy(first_backoff_s=0.05, max_backoff_s=0.1)


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), (BlockStored((i.to_bytes(32, "big"),), None, 16),))


def _snapshot(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), (AllBlocksCleared(), *_batch(i).events))


def _wait(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def setup(redis_url):
    client = redis.Redis.from_url(redis_url)
    pub = KVEventPublisher(parse_store_url(redis_url), STREAM, policy=FAST)
    yield pub, client
    pub.close()
    client.close()


def _stream(client) -> list[KVEventBatch]:
    return [KVEventBatch.from_json(f[b"batch"]) for _, f in client.xrange(STREAM)]


@pytest.mark.parametrize("spoil", ["largest id", "another type"])
def test_a_spoiled_stream_is_reset_and_publishing_goes_on(setup, spoil):
    pub, client = setup
    assert pub.submit(_batch(1)) and pub.flush(5)
    if spoil == "largest id":
        client.xadd(STREAM, {"batch": "x"}, id=MAX_ID)
    else:
        client.delete(STREAM)
        client.set(STREAM, "x")
    assert pub.submit(_batch(2)) and pub.flush(5)  # refused: the stream is reset
    assert pub.counts.stream_resets == 1 and pub.snapshot_wanted() and not pub.is_down
    assert not pub.submit(_batch(3))  # a delta on a state the new stream lacks: dropped
    assert pub.submit(_snapshot(3), snapshot=True) and pub.flush(5)
    assert pub.submit(_batch(4)) and pub.flush(5)
    assert _stream(client) == [_snapshot(3), _batch(4)]  # the fresh stream, snapshot first
    assert pub.counts.stream_resets == 1 and pub.counts.batches_dropped == 2


def test_spoiled_again_right_after_a_reset_backs_off(setup):
    pub, client = setup
    client.xadd(STREAM, {"batch": "x"}, id=MAX_ID)
    assert pub.submit(_batch(1)) and pub.flush(5)
    assert pub.counts.stream_resets == 1 and not pub.is_down
    client.xadd(STREAM, {"batch": "x"}, id=MAX_ID)  # again, before anything was published
    assert pub.submit(_snapshot(2), snapshot=True) and pub.flush(5)
    assert pub.counts.stream_resets == 2 and pub.is_down  # an outage: back off, ping, snapshot
    _wait(pub.snapshot_wanted)  # the ping answered
    assert pub.submit(_snapshot(3), snapshot=True) and pub.flush(5)
    assert _stream(client) == [_snapshot(3)] and not pub.is_down


def test_another_refusal_is_an_outage_not_a_reset(setup):
    pub, client = setup
    assert pub.submit(_batch(1)) and pub.flush(5)
    client.config_set("maxmemory", 1)  # every write refused: OOM
    try:
        assert pub.submit(_batch(2)) and pub.flush(5)
        assert pub.counts.stream_resets == 0 and pub.is_down and pub.counts.publish_errors >= 1
    finally:
        client.config_set("maxmemory", 0)
    _wait(pub.snapshot_wanted)
    assert pub.submit(_snapshot(3), snapshot=True) and pub.flush(5)
    assert _stream(client)[-1] == _snapshot(3) and pub.counts.stream_resets == 0


def test_a_batch_over_the_caps_is_several_entries(setup):
    pub, client = setup
    n = 2 * MAX_HASHES_PER_ENTRY + 5
    run = tuple(i.to_bytes(32, "big") for i in range(n))
    big = KVEventBatch(1.0, (AllBlocksCleared(), BlockStored(run, None, 16)))
    assert pub.submit(big, snapshot=True) and pub.flush(10)
    parts = _stream(client)  # each entry is one a reader takes (from_json would raise)
    assert len(parts) == 4 and pub.counts.batches_published == 1  # the clear, 16k, 16k, 5
    assert parts[0].events == (AllBlocksCleared(),)
    assert [h for p in parts[1:] for e in p.events for h in e.block_hashes] == list(run)
