"""The embedded SmolLM2-135M (9 query heads, 3 KV heads) at tensor-parallel size 3 (two worker
processes, one KV head a rank): in fp32 its greedy tokens equal the single-rank engine's."""

from __future__ import annotations

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.conftest import assert_no_leaks

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain paging in one sentence.",
    "Why is the sky blue?",
]
NEW_TOKENS = 32


@pytest.mark.slow
def test_tp3_greedy_tokens_equal_one_ranks(make_engine):
    one = make_engine(kv_cache_memory_bytes=64 << 20)
    prompts = [one.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    config = EngineConfig(
        kv_cache_memory_bytes=64 << 20, max_model_len=512, log_startup=False, tensor_parallel_size=3
    )
    three = LLMEngine(config)
    try:
        page = three.parts.page_format
        assert [page.tp_size, page.num_kv_heads, page.model_kv_heads] == [3, 1, 3]
        got = [o.outputs[0].token_ids for o in three.generate(prompts, params)]
        assert got == want
        assert_no_leaks(three)
    finally:
        three.close()
