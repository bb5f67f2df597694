"""The store tier in the engine, on a real redis-server and the tiny random Llama: two
processes share a prefix; salts isolate; a killed store, a flipped byte and a foreign payload
are all recomputed to the same greedy tokens; invariants after every step, no block leaks."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model

PROMPT = "The shared system prompt: be brief. " * 2 + "Answer in one line. "  # 90 tokens
PROMPTS = [PROMPT + "Q1?", PROMPT + "Q2, longer?"]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


def make_engine(loaded, url: str | None) -> LLMEngine:
    config = EngineConfig(log_startup=False, max_model_len=128, kv_store=url)
    return LLMEngine(config, parts=build_parts(config, loaded))


def store_of(engine: LLMEngine):
    return engine.parts.kv_store


def run(engine: LLMEngine, prompts: list[str], salt: str | None = None, each_step=None):
    """Greedy tokens of ``prompts`` and their cached-token counts; invariants every step."""
    ids = [engine.add_request(p, GREEDY, cache_salt=salt) for p in prompts]
    done = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.allocator.check_invariants()
        step += 1
        if each_step is not None:
            each_step(step)
    outs = [done[r] for r in ids]
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def assert_no_leaks(engine: LLMEngine) -> None:
    engine.allocator.check_invariants()
    stats = engine.allocator.stats()
    assert stats.num_used_blocks == 0 and stats.num_seqs == 0, stats


@pytest.fixture(scope="module")
def cold(tiny):
    """The reference: each prompt alone in an engine without a store."""
    tokens = []
    for prompt in PROMPTS:
        (t,), cached = run(make_engine(tiny, None), [prompt])
        assert cached == [0]
        tokens.append(t)
    return tokens


def worker(folder: Path, url: str, prompts: list[str], salt: str = "") -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "tests.kvstore.store_worker", str(folder), url, salt],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_two_processes_share_a_prefix_through_the_store(tiny_folder, redis_url, cold):
    first = worker(tiny_folder, redis_url, PROMPTS[:1])
    assert first["tokens"] == cold[:1] and first["store"]["hit_tokens"] == 0
    assert first["store"]["blocks_written"] > 0
    second = worker(tiny_folder, redis_url, PROMPTS)
    assert second["tokens"] == cold
    assert second["store"]["hit_tokens"] > 0
    assert second["cached_tokens"][0] >= second["store"]["hit_tokens"] // 2
    other_salt = worker(tiny_folder, redis_url, PROMPTS[:1], salt="tenant-b")
    assert other_salt["store"]["hit_tokens"] == 0 and other_salt["tokens"] == cold[:1]


def test_another_model_of_the_same_shape_gets_no_hit(tiny, tmp_path, redis_url):
    from tests.model.tiny import make_tiny_model

    make_tiny_model("llama", tmp_path, seed=1)
    writer = make_engine(tiny, redis_url)
    run(writer, PROMPTS[:1])
    assert store_of(writer).flush(30)
    reader = make_engine(load_model(tmp_path, progress=False), redis_url)
    run(reader, PROMPTS[:1])
    assert store_of(reader).counters.hit_tokens == 0
    assert store_of(reader).namespace != store_of(writer).namespace


def second_block_hash(engine: LLMEngine) -> bytes:
    """The chained hash of PROMPTS[0]'s second block (no salt), as the allocator computes it."""
    from pagedkv.kvcache.hashing import NO_EXTRA_KEYS, hash_blocks, root_hash

    ids = engine.tokenizer.encode(PROMPTS[0])
    return hash_blocks(ids, engine.allocator.block_size, root_hash(NO_EXTRA_KEYS))[1]


def corrupt_second_block(engine: LLMEngine, url: str, mutate) -> None:
    """Rewrite the stored payload of PROMPTS[0]'s second block with ``mutate(payload)``."""
    import redis

    raw = redis.Redis.from_url(url)
    key = store_of(engine).key(second_block_hash(engine))
    payload = raw.get(key)
    assert payload is not None, "the second block was not written"
    raw.set(key, mutate(payload))
    raw.close()


def test_a_flipped_byte_is_rejected_and_recomputed(tiny, redis_url, cold, caplog):
    writer = make_engine(tiny, redis_url)
    run(writer, PROMPTS[:1])
    assert store_of(writer).flush(30)

    def flip(payload: bytes) -> bytes:
        b = bytearray(payload)
        b[len(b) // 2] ^= 0x01
        return bytes(b)

    corrupt_second_block(writer, redis_url, flip)
    reader = make_engine(tiny, redis_url)
    with caplog.at_level(logging.WARNING, "pagedkv.kvstore"):
        tokens, cached = run(reader, PROMPTS[:1])
    counters = store_of(reader).counters
    assert tokens == cold[:1]
    assert counters.rejected["bad_checksum"] == 1
    assert counters.hit_tokens == reader.allocator.block_size  # only the block before it
    assert cached == [reader.allocator.block_size]
    assert_no_leaks(reader)


def test_a_foreign_payload_under_our_key_is_rejected(tiny, redis_url, cold):
    from pagedkv.kvstore.codec import decode_payload, encode_payload

    writer = make_engine(tiny, redis_url)
    run(writer, PROMPTS[:1])
    assert store_of(writer).flush(30)
    tier = store_of(writer)

    def foreign(payload: bytes) -> bytes:  # the same block, as another page format wrote it
        h = second_block_hash(writer)
        body = decode_payload(payload, tier.namespace, h, tier.body_bytes)
        return encode_payload(bytes(16), h, body)

    corrupt_second_block(writer, redis_url, foreign)
    reader = make_engine(tiny, redis_url)
    tokens, _ = run(reader, PROMPTS[:1])
    assert tokens == cold[:1]
    assert store_of(reader).counters.rejected["foreign_format"] == 1
    assert_no_leaks(reader)


def test_store_killed_mid_run_everything_completes(tiny, own_redis, cold, caplog):
    writer = make_engine(tiny, own_redis.url)
    run(writer, PROMPTS[:1])
    assert store_of(writer).flush(30)
    engine = make_engine(tiny, own_redis.url)

    def kill_after_first_step(step: int) -> None:
        if step == 1:
            own_redis.stop()

    with caplog.at_level(logging.WARNING, "pagedkv.kvstore"):
        tokens, _ = run(engine, PROMPTS + [PROMPT + "Q3"], each_step=kill_after_first_step)
        # More requests while it is down: misses, recomputed, not logged again.
        run(engine, [PROMPT[::-1]])
    assert tokens[:2] == cold
    counters = store_of(engine).counters
    assert counters.errors >= 1
    outage_logs = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(outage_logs) == 1, [r.getMessage() for r in caplog.records]
    assert_no_leaks(engine)


def test_store_down_at_start_up_is_served_without_it(tiny, cold, caplog):
    from tests.kvstore.redis_server import free_port

    with caplog.at_level(logging.WARNING, "pagedkv.kvstore"):
        engine = make_engine(tiny, f"redis://127.0.0.1:{free_port()}")
        tokens, _ = run(engine, PROMPTS)
    assert tokens == cold
    assert "NOT answering" in engine.parts.startup_report
    assert store_of(engine).counters.errors >= 1
    assert_no_leaks(engine)
