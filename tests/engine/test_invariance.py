"""Greedy tokens must not depend on how the KV cache is paged or batched: block sizes 1, 16 and
128; paged, radix and reserved allocators; alone or in a batch of 16; with and without a prefix
hit; after forced preemption and recompute. No block leaks afterwards."""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams

from .conftest import assert_no_leaks

SYSTEM = "You are a helpful assistant who answers questions about geography and history. "
PROMPTS = [
    SYSTEM + "What is the capital of France?",
    SYSTEM + "Name a river in Egypt.",
    "The quick brown fox",
    "def fibonacci(n):",
]
FILLER = [f"Count from {i} to {i + 5}:" for i in range(12)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(embedded):
    """Each prompt alone, paged B=16: the tokens every other arrangement must reproduce."""
    from pagedkv.engine import EngineConfig, LLMEngine
    from pagedkv.engine.startup import build_parts

    config = EngineConfig(log_startup=False, max_model_len=512)
    engine = LLMEngine(config, parts=build_parts(config, embedded))
    tokens = []
    for p in PROMPTS:
        (out,) = engine.generate([p], GREEDY)
        tokens.append(out.outputs[0].token_ids)
    assert all(len(t) == 12 for t in tokens)
    return tokens


def outputs_of(engine, prompts):
    outs = engine.generate(prompts, GREEDY)
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "policy, block_size",
    [("vllm", 1), ("vllm", 16), ("vllm", 128), ("sglang", None), ("radix:16", None),
     ("reserved", None), ("llamacpp", None)],
)  # fmt: skip
def test_batch_of_16_matches_alone(make_engine, reference, policy, block_size):
    engine = make_engine(policy=policy, block_size=block_size, kv_cache_memory_bytes=96 << 20)
    got = outputs_of(engine, PROMPTS + FILLER)
    assert got[: len(PROMPTS)] == reference
    assert_no_leaks(engine)


@pytest.mark.parametrize("policy", ["vllm", "sglang"])
def test_prefix_hit_gives_same_tokens(make_engine, reference, policy):
    engine = make_engine(policy=policy)
    first = outputs_of(engine, PROMPTS[:2])
    before = engine.allocator.stats().prefix_hit_tokens
    outs = engine.generate(PROMPTS[:2], GREEDY)  # same prompts: their blocks are cached now
    assert [o.outputs[0].token_ids for o in outs] == first == reference[:2]
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert engine.allocator.stats().prefix_hit_tokens > before
    assert_no_leaks(engine)


@pytest.mark.parametrize("policy", ["vllm", "reserved"])
def test_preemption_and_recompute_give_same_tokens(make_engine, reference, policy):
    # A pool far too small for the batch: sequences are preempted and recomputed.
    kv = 5 << 20 if policy == "vllm" else 48 << 20  # ~110 tokens; or 2 reserved regions
    engine = make_engine(policy=policy, kv_cache_memory_bytes=kv, max_model_len=128)
    got = outputs_of(engine, PROMPTS)
    assert got == reference
    if policy == "vllm":
        assert engine.stats().preemptions > 0
    assert_no_leaks(engine)
