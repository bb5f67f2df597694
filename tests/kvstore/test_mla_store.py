"""MLA latent pages through the Redis store and the host tier (issue 55), on a real
redis-server and the tiny random DeepSeek-V3 (``tests/model/tiny.py``): a prompt another engine
wrote through comes from the store, then (evicted from the device) from the host tier, and the
greedy tokens equal a cold run's each time. A store body is ``record_bytes * block_size``
bytes: one latent record per token and layer."""

from __future__ import annotations

import random

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from tests.engine.test_host_tier import run  # one stepping loop, invariants each step

RECORD_BYTES = 3 * (32 + 8) * 4  # 3 layers x (rank 32 + rope 8) x fp32
_rng = random.Random(13)
PROMPT = [_rng.randrange(256) for _ in range(60)]  # 3 full blocks of 16 can hit
DISTRACTORS = [[_rng.randrange(256) for _ in range(90)] for _ in range(2)]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from pagedkv.model import load_model
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-deepseek-store")
    make_tiny_model("deepseek_v3", folder)
    return load_model(folder, progress=False)


def engine_with(loaded, url: str | None) -> LLMEngine:
    config = EngineConfig(
        block_size=16,
        kv_cache_memory_bytes=(96 + 16) * RECORD_BYTES,  # 6 usable blocks (+ the null block)
        host_kv_memory_bytes=1 << 20,
        kv_store=url,
        max_model_len=128,
        log_startup=False,
    )
    return LLMEngine(config, parts=build_parts(config, loaded))


def test_latent_pages_from_the_store_then_the_host(deepseek, redis_url):
    cold = engine_with(deepseek, None)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)  # as run()
    want = cold.generate([PROMPT], greedy)[0].outputs[0].token_ids
    writer = engine_with(deepseek, redis_url)
    assert writer.parts.kv_store.body_bytes == 16 * RECORD_BYTES
    assert run(writer, PROMPT).outputs[0].token_ids == want
    assert writer.parts.kv_store.flush(30)

    reader = engine_with(deepseek, redis_url)
    first = run(reader, PROMPT)
    assert first.num_cached_tokens == 48 and first.outputs[0].token_ids == want
    assert dict(reader.allocator.stats().tier_hit_tokens) == {"device": 0, "host": 0, "store": 48}
    for d in DISTRACTORS:  # evict the prompt from the device: offloaded to the host tier
        run(reader, d)
    again = run(reader, PROMPT)
    assert again.num_cached_tokens == 48 and again.outputs[0].token_ids == want
    assert dict(reader.allocator.stats().tier_hit_tokens)["host"] == 48
