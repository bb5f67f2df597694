"""A real engine's KV event stream while a third party writes to it (issue 27), on a real
redis-server, read by the router's own ``IndexFeed`` + ``KVEventReader``: bad entries are
skipped and the publisher's next batches still arrive; an entry at the largest stream ID (after
which Redis refuses every ``XADD *``) makes the publisher reset its stream and publish a
snapshot, the reader notices the reset and reads the new stream from its start, and the
router's index matches the engine's ``held_hashes`` again."""

from __future__ import annotations

import contextlib
import json
import time

import redis

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.kv.events import held_hashes
from pagedkv.engine.startup import build_parts
from pagedkv.router.event_reader import KVEventReader
from pagedkv.router.replicas import IndexFeed

MAX_ID = "18446744073709551615-18446744073709551615"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[(i * 17 + j * 5) % 240 + 10 for j in range(40 + 7 * i)] for i in range(8)]
H = "ab" * 32
STORED = {"type": "BlockStored", "block_hashes": [H], "parent_block_hash": None, "block_size": 16}
BAD = [
    json.dumps({"ts": 1, "events": [STORED]}).replace('"block_size": 16', '"block_size": 1e400'),
    "[" * 100_000 + "]" * 100_000,
    json.dumps({"ts": 1, "events": [{**STORED, "block_hashes": ["0a"] * 300_000}]}),
    json.dumps({"ts": 1, "events": [{**STORED, "block_size": "16"}]}),
    "not json",
]
REPLICA = "http://replica:1"


def _wait(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _run(engine: LLMEngine, prompts) -> None:
    for p in prompts:
        engine.add_request(p, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None


def _holds(feed: IndexFeed) -> set[bytes]:
    with feed._lock:
        return feed._index.holds(REPLICA)


def _assert_synced(engine: LLMEngine, feed: IndexFeed, client: redis.Redis) -> None:
    """Publish what the engine owes (a snapshot it was asked for: the engine is idle, so the
    test drains as the server's idle loop would), wait until the reader has read the stream's
    newest entry, then compare the router's index with the engine's cache."""
    kv = engine.parts.kv_events
    assert kv.publisher.flush(5)
    while kv.publisher.snapshot_wanted():
        kv.after_step()
        assert kv.publisher.flush(5)
    (newest,) = [entry_id.decode() for entry_id, _ in client.xrevrange(kv.stream, count=1)]
    (device,) = [set(hashes) for medium, hashes in held_hashes(engine.allocator)]
    reader = feed.reader(REPLICA)
    with contextlib.suppress(AssertionError):  # the assertions below say what differs
        _wait(lambda: reader.last_id == newest and _holds(feed) == device)
    assert reader.last_id == newest
    assert _holds(feed) == device
    assert device  # the cache holds something, and the router knows exactly that


def test_the_stream_survives_a_third_party(tiny_llama, redis_server):
    config = EngineConfig(log_startup=False, max_model_len=128, kv_cache_memory_bytes=12 * 8192,
                          max_num_seqs=2, kv_events_url=redis_server.url)  # fmt: skip
    engine = LLMEngine(config, parts=build_parts(config, tiny_llama))
    kv = engine.parts.kv_events
    feed = IndexFeed(lambda url, stream, cb: KVEventReader(url, stream, cb, block_ms=20))
    feed.follow(REPLICA, redis_server.url, kv.stream)
    reader = feed.reader(REPLICA)
    third_party = redis.Redis.from_url(redis_server.url)
    try:
        _run(engine, PROMPTS[:3])
        _assert_synced(engine, feed, third_party)
        for text in BAD:  # each bad entry, then the engine's next batches
            third_party.xadd(kv.stream, {"batch": text})
            _run(engine, PROMPTS[3:5])
            _assert_synced(engine, feed, third_party)
        assert reader.num_malformed == len(BAD) and reader._thread.is_alive()
        third_party.xadd(kv.stream, {"batch": "x"}, id=MAX_ID)
        _wait(lambda: reader.last_id == MAX_ID)  # read (and skipped) before the reset
        _run(engine, PROMPTS[5:])  # its XADDs are refused: the stream is reset
        _assert_synced(engine, feed, third_party)  # the snapshot, read from the new stream's start
        assert kv.publisher.counts.stream_resets == 1 and reader.num_resets == 1
        _run(engine, PROMPTS[:2])  # and deltas flow again
        _assert_synced(engine, feed, third_party)
        assert kv.publisher.counts.stream_resets == 1
    finally:
        third_party.close()
        for r in feed.readers():
            r.stop()
        kv.close()
