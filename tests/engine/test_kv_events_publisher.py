"""``KVEventPublisher`` alone against a real redis-server: a full queue and a hung server make
it *lost* (ordinary batches dropped and counted) until a snapshot; periodic snapshots."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from pagedkv.kvcache.events import AllBlocksCleared, BlockStored, KVEventBatch
from pagedkv.kvstore.address import parse_store_url
from pagedkv.kvstore.event_publisher import KVEventPublisher
from tests.kvstore.redis_server import RedisServer

STREAM = "pagedkv:kv-events:pub"


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path).start()
    yield s
    s.stop()


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), (BlockStored((i.to_bytes(32, "big"),), None, 16),))


def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _stream(server) -> list[KVEventBatch]:
    client = redis.Redis.from_url(server.url)
    try:
        return [KVEventBatch.from_json(f[b"batch"]) for _, f in client.xrange(STREAM)]
    finally:
        client.close()


def test_full_queue_drops_until_a_snapshot(server):
    pub = KVEventPublisher(parse_store_url(server.url), STREAM, max_queued_batches=2)
    try:
        assert pub.submit(_batch(0)) and pub.flush(5)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            assert pub.submit(_batch(1))
            _wait(lambda: pub.num_queued == 0 and pub.num_in_flight == 1)  # taken: it waits on
            # the hung server, so the queue has room for exactly max_queued_batches again
            assert pub.submit(_batch(2)) and pub.submit(_batch(3))
            assert not pub.submit(_batch(4))  # the queue is full: dropped, now lost
            assert pub.snapshot_wanted()
            assert not pub.submit(_batch(5))  # a delta on a lost state: dropped too
            _wait(lambda: pub.counts.publish_errors >= 1)  # the XADD timed out
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        _wait(pub.snapshot_wanted)  # Redis answers again
        snapshot = KVEventBatch(9.0, (AllBlocksCleared(), *_batch(9).events))
        assert pub.submit(snapshot, snapshot=True) and pub.flush(5)
        assert pub.submit(_batch(10)) and pub.flush(5)
        assert pub.counts.batches_dropped >= 2 and pub.counts.snapshots_published == 1
        tail = _stream(server)[-2:]
        assert tail == [snapshot, _batch(10)]  # after whatever late XADDs landed
    finally:
        pub.close()


def test_periodic_snapshot_is_requested(server):
    pub = KVEventPublisher(parse_store_url(server.url), STREAM, snapshot_every_batches=3)
    try:
        for i in range(2):
            pub.submit(_batch(i))
        assert pub.flush(5) and not pub.snapshot_wanted()
        pub.submit(_batch(2))
        assert pub.flush(5) and pub.snapshot_wanted()
        pub.submit(KVEventBatch(3.0, (AllBlocksCleared(),)), snapshot=True)
        assert pub.flush(5) and not pub.snapshot_wanted()
        assert pub.counts.batches_published == 4 and pub.counts.events_dropped == 0
    finally:
        pub.close()
