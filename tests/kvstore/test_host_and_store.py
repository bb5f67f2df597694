"""Host tier and store together (lookup order: device, host, store), on a real redis-server
and the tiny random Llama: a prompt another engine wrote through comes from the store; once
the device evicts it, from the host tier (the cheaper tier first, the store no longer asked);
greedy tokens equal a cold run every time; invariants after every step, no leaks."""

from __future__ import annotations

import random

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from tests.engine.test_host_tier import run  # one stepping loop, invariants each step

RECORD_BYTES = 512  # the tiny llama: 2 layers x 2 KV heads x 16 dims x K,V x fp32
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
_rng = random.Random(11)
PROMPT = [_rng.randrange(256) for _ in range(60)]  # 3 full blocks of 16 can hit
DISTRACTORS = [[_rng.randrange(256) for _ in range(90)] for _ in range(2)]


def engine_with(tiny, url: str | None, host_bytes: int) -> LLMEngine:
    config = EngineConfig(
        block_size=16,
        kv_cache_memory_bytes=(96 + 16) * RECORD_BYTES,  # 6 usable blocks (+ the null block)
        host_kv_memory_bytes=host_bytes,
        kv_store=url,
        max_model_len=128,
        log_startup=False,
    )
    return LLMEngine(config, parts=build_parts(config, tiny))


def test_store_then_host(tiny, redis_url):
    cold = engine_with(tiny, None, 1 << 20)
    want = run(cold, PROMPT).outputs[0].token_ids

    writer = engine_with(tiny, redis_url, 1 << 20)
    assert run(writer, PROMPT).outputs[0].token_ids == want
    assert writer.parts.kv_store.flush(30)

    reader = engine_with(tiny, redis_url, 1 << 20)
    first = run(reader, PROMPT)
    assert first.num_cached_tokens == 48 and first.outputs[0].token_ids == want
    assert dict(reader.allocator.stats().tier_hit_tokens) == {"device": 0, "host": 0, "store": 48}

    for d in DISTRACTORS:  # evict the prompt from the device: offloaded to the host tier
        run(reader, d)
    again = run(reader, PROMPT)
    assert again.num_cached_tokens == 48 and again.outputs[0].token_ids == want
    hits = dict(reader.allocator.stats().tier_hit_tokens)
    assert hits == {"device": 0, "host": 48, "store": 48}  # the host tier answered first
    moves = reader.snapshot().tier_moves
    assert moves.blocks[("host", "loaded")] == 3 and moves.blocks[("store", "loaded")] == 3
    stats = reader.allocator.stats()
    assert stats.num_used_blocks == 0 and stats.num_seqs == 0
