"""KV events of a real engine (a tiny model), published to a real redis-server and read back with
the router's ``KVEventReader``: after every step the replayed set equals what the allocator
holds; greedy tokens do not change; a Redis outage costs events, never a request, and the
snapshot after it makes the reader right again."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.kv.events import held_hashes
from pagedkv.engine.startup import build_parts
from pagedkv.kvcache.events import MEDIUM_DEVICE, MEDIUM_HOST, KVEventBatch, replay
from pagedkv.kvstore import redis_policy
from pagedkv.router.event_reader import KVEventReader

# The shared Redis policy with a short back-off, so that a test sees a recovery within 0.2 s.
FAST_RETRY = redis_policy.RedisPolicy(first_backoff_s=0.1, max_backoff_s=0.2)

SYSTEM = [(5 * i + 11) % 240 + 10 for i in range(40)]  # a shared prefix of 2.5 blocks of 16
PROMPTS = [SYSTEM + [(i * 13 + j) % 240 + 10 for j in range(6 + 3 * i)] for i in range(6)]
PROMPTS += [[(i * 31 + j * 7) % 240 + 10 for j in range(50)] for i in range(3)]  # no sharing
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class View:
    """What a router knows of one replica: the replay of its stream, per medium."""

    def __init__(self) -> None:
        self.held = {MEDIUM_DEVICE: set(), MEDIUM_HOST: set()}

    def __call__(self, batch: KVEventBatch) -> None:
        for medium, held in self.held.items():
            replay(batch.events, held, medium)


def _engine(tiny_llama, **overrides) -> LLMEngine:
    # 12 blocks of 16 tokens: the prompts below evict each other's cached blocks.
    overrides = {"log_startup": False, "max_model_len": 128, "kv_cache_memory_bytes": 12 * 8192,
                 "max_num_seqs": 2, **overrides}  # fmt: skip
    config = EngineConfig(**overrides)
    return LLMEngine(config, parts=build_parts(config, tiny_llama))


def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _assert_synced(engine: LLMEngine, reader: KVEventReader, view: View) -> None:
    publisher = engine.parts.kv_events.publisher
    assert publisher.flush(5)
    # Every published batch read, and the device view caught up: a batch that a hung Redis
    # took after its XADD timed out (counted dropped, yet in the stream) is read too, so the
    # count alone could be reached one real batch early.
    # (A set compared in one C call: the reader thread cannot change it halfway.)
    with contextlib.suppress(AssertionError):  # timed out: the assertions below say what differs
        _wait(
            lambda: (
                reader.num_batches >= publisher.counts.batches_published
                and view.held[MEDIUM_DEVICE] == engine.allocator.prefix_hashes()
            )
        )
    expected = dict(held_hashes(engine.allocator))
    assert view.held[MEDIUM_DEVICE] == engine.allocator.prefix_hashes()
    assert view.held[MEDIUM_HOST] == set(expected.get(MEDIUM_HOST, ()))


def _run(engine: LLMEngine, prompts, check=None) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.error is None
                done[out.request_id] = out.outputs[0].token_ids
        if check is not None:
            check()
    return [done[i] for i in ids]


@pytest.mark.parametrize(
    "overrides",
    [
        {"policy": "vllm"},
        {"policy": "radix:4"},
        {"policy": "vllm", "host_kv_memory_bytes": 4 * 8192},
    ],
    ids=["paged16", "radix4", "paged16+host"],
)
def test_replayed_stream_equals_the_cache_after_every_step(tiny_llama, redis_server, overrides):
    reference = _run(_engine(tiny_llama, **overrides), PROMPTS)  # events off
    engine = _engine(tiny_llama, kv_events_url=redis_server.url, **overrides)
    view = View()
    reader = KVEventReader.from_info(
        {"url": redis_server.url, "stream": engine.parts.kv_events.stream}, view, block_ms=20
    ).start()
    try:
        _assert_synced(engine, reader, view)  # the opening AllBlocksCleared
        tokens = _run(engine, PROMPTS, lambda: _assert_synced(engine, reader, view))
        assert tokens == reference  # events change nothing the model computes
        counts = engine.parts.kv_events.counts()
        assert counts["events_dropped"] == 0 and counts["publish_errors"] == 0
        assert engine.allocator.prefix_hashes()  # something was cached (and compared)
        assert engine.parts.kv_events.log.num_removed_blocks > 0  # and evicted
        assert reader.num_malformed == 0
    finally:
        reader.stop()
        engine.parts.kv_events.close()


def test_redis_outage_costs_events_not_requests(tiny_llama, redis_server, monkeypatch, caplog):
    monkeypatch.setattr(redis_policy, "REDIS_POLICY", FAST_RETRY)
    engine = _engine(tiny_llama, kv_events_url=redis_server.url)
    view = View()
    reader = KVEventReader(redis_server.url, engine.parts.kv_events.stream, view, block_ms=20)
    reader.start()
    publisher = engine.parts.kv_events.publisher
    try:
        _run(engine, PROMPTS[:3])
        _assert_synced(engine, reader, view)
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="pagedkv.kv_events"):
            _run(engine, PROMPTS[3:])  # every request completes while Redis is down
            assert publisher.flush(5)  # the failing XADDs run off-thread
        assert publisher.counts.events_dropped > 0 and publisher.counts.publish_errors > 0
        mine = [r for r in caplog.records if r.name == "pagedkv.kv_events"]
        assert len(mine) == 1 and "failed" in mine[0].getMessage()  # once per outage
        redis_server.start()  # same port, empty: the old entries are gone
        _wait(lambda: publisher.snapshot_wanted(), timeout_s=10)
        _run(engine, PROMPTS[:2])  # the next steps submit the snapshot, then deltas
        assert publisher.flush(5)  # sent off-thread: a fast run can end before the XADD
        assert publisher.counts.snapshots_published >= 1
        _wait(lambda: reader.connected)
        _assert_synced(engine, reader, view)
    finally:
        reader.stop()
        engine.parts.kv_events.close()


def test_a_hung_redis_never_slows_a_step(tiny_llama, redis_server, monkeypatch):
    monkeypatch.setattr(redis_policy, "REDIS_POLICY", FAST_RETRY)
    engine = _engine(tiny_llama, kv_events_url=redis_server.url)
    publisher = engine.parts.kv_events.publisher
    assert publisher.flush(5)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        # The property, checked without a clock: no Redis command runs on the engine thread
        # (a step only queues its batch), so a hung Redis cannot hold a step.
        callers: list[str] = []

        def recorded(call):
            def wrapper(*args, **kwargs):
                callers.append(threading.current_thread().name)
                return call(*args, **kwargs)

            return wrapper

        for name in ("pipeline", "ping", "xadd", "execute_command"):  # every way to Redis
            setattr(publisher._redis, name, recorded(getattr(publisher._redis, name)))
        engine_thread = threading.current_thread().name
        for p in PROMPTS:
            engine.add_request(p, GREEDY)
        while engine.has_unfinished():
            engine.step()
        _wait(lambda: bool(callers))  # the publisher did try to send the steps' batches
        assert engine_thread not in callers
        _wait(lambda: publisher.counts.publish_errors > 0)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    view = View()
    reader = KVEventReader(redis_server.url, publisher.stream, view, block_ms=20).start()
    try:
        _wait(lambda: publisher.snapshot_wanted(), timeout_s=10)
        _run(engine, PROMPTS[:1])
        _assert_synced(engine, reader, view)
        assert publisher.counts.batches_dropped > 0
    finally:
        reader.stop()
        engine.parts.kv_events.close()


def test_an_idle_server_publishes_the_snapshot_it_owes(tiny_llama, redis_server, monkeypatch):
    """Redis comes back while no request is running: the server's idle loop, not the next
    request, sends the snapshot that makes a router's view right again."""
    from pagedkv.server import engine_loop

    monkeypatch.setattr(redis_policy, "REDIS_POLICY", FAST_RETRY)
    monkeypatch.setattr(engine_loop, "IDLE_WAKE_S", 0.05)
    engine = _engine(tiny_llama, kv_events_url=redis_server.url)
    publisher = engine.parts.kv_events.publisher
    _run(engine, PROMPTS[:3])
    redis_server.stop()
    _run(engine, PROMPTS[3:5])  # these changes are lost with the outage
    loop = engine_loop.EngineLoop(engine)
    loop.start()
    view = View()
    reader = None
    try:
        redis_server.start()  # empty: a reader can only learn the cache from a snapshot
        _wait(lambda: publisher.counts.snapshots_published >= 1, timeout_s=15)
        reader = KVEventReader(redis_server.url, publisher.stream, view, block_ms=20).start()
        _wait(lambda: view.held[MEDIUM_DEVICE] == engine.allocator.prefix_hashes())
        assert view.held[MEDIUM_DEVICE]  # the cache holds something, and the reader knows it
    finally:
        if reader is not None:
            reader.stop()
        loop.stop()
        engine.parts.kv_events.close()
