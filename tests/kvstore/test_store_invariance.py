"""Greedy tokens are the same whether a prompt's prefix is computed or read from the store:
block sizes 1, 16 and 64 on the tiny Llama, and B = 16 on the embedded SmolLM2."""

from __future__ import annotations

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts

from .test_engine_store import PROMPTS, assert_no_leaks, run, store_of


def engine(loaded, url, block_size, max_model_len=128):
    config = EngineConfig(
        log_startup=False, max_model_len=max_model_len, kv_store=url, block_size=block_size
    )
    return LLMEngine(config, parts=build_parts(config, loaded))


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_store_hit_equals_cold(tiny, redis_url, block_size):
    cold, _ = run(engine(tiny, None, block_size), PROMPTS[:1])
    writer = engine(tiny, redis_url, block_size)
    assert run(writer, PROMPTS[:1])[0] == cold
    assert store_of(writer).flush(30)
    reader = engine(tiny, redis_url, block_size)
    tokens, cached = run(reader, PROMPTS[:1])
    assert tokens == cold
    full = (len(reader.tokenizer.encode(PROMPTS[0])) - 1) // block_size * block_size
    assert cached == [full] and store_of(reader).counters.hit_tokens == full
    assert_no_leaks(reader)


@pytest.mark.slow
def test_embedded_model_store_hit_equals_cold(embedded, redis_url):
    prompt = "You are a careful assistant. " * 30 + "Name three rivers in Europe."
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = []
    for url in (None, redis_url, redis_url):  # cold without a store, writer, reader
        e = engine(embedded, url, 16, max_model_len=512)
        (out,) = e.generate([prompt], greedy)
        outs.append(out)
        if url:
            assert store_of(e).flush(60)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert outs[1].num_cached_tokens == 0 and outs[2].num_cached_tokens >= 160


def test_host_tier_and_store_together(tiny, redis_url):
    """Store hit first; then distractors evict the prompt into the host tier, and the next hit
    comes from the host tier, not the store. Same tokens throughout."""
    config = dict(log_startup=False, max_model_len=128, kv_store=redis_url,
                  kv_cache_memory_bytes=12 * 16 * 512, host_kv_memory_bytes=1 << 20)  # fmt: skip
    cold, _ = run(engine(tiny, None, 16), PROMPTS[:1])
    writer = LLMEngine(EngineConfig(**config), parts=build_parts(EngineConfig(**config), tiny))
    run(writer, PROMPTS[:1])
    assert store_of(writer).flush(30)
    reader = LLMEngine(EngineConfig(**config), parts=build_parts(EngineConfig(**config), tiny))

    def hits():
        return dict(reader.allocator.stats().tier_hit_tokens)

    assert run(reader, PROMPTS[:1])[0] == cold
    assert hits()["store"] > 0 and hits()["host"] == 0
    run(reader, ["x" * 100, "y" * 100])  # evict the prompt's blocks into the host tier
    store_before = hits()["store"]
    assert run(reader, PROMPTS[:1])[0] == cold
    assert hits()["host"] > 0 and hits()["store"] == store_before
    assert_no_leaks(reader)
