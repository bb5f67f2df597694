"""Tensor parallelism at 2 ranks (one worker process each engine), gloo on the CPU: the greedy
tokens equal transformers' on the same weights and the single-rank engine's, for heads that
split (the tiny Llama, scheduled one step ahead: each step's drawn ids broadcast from rank 0;
and Qwen2: bias, tied embeddings) and for KV heads replicated (one KV head on two ranks);
prompt log-probabilities (logits outside a step), the host tier's KV (evicted and loaded on
every rank) and quantized weights equal the single rank's too.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model
from tests.engine.conftest import assert_no_leaks
from tests.model.tiny import make_tiny_model

PROMPTS = [[200, 1, 2], list(range(30, 67)), [9, 250, 3, 77, 140, 66], [5, 17, 40, 99, 12, 7]]
NEW_TOKENS = 8
CASES = {  # (family, the model's overrides, the TP 2 engine's)
    "split-llama": ("llama", {}, {"async_scheduling": True}),  # 4 query, 2 KV heads: 2, 1 a rank
    "split-qwen2": ("qwen2", {}, {}),  # q/k/v biases split with their heads; tied vocab rows
    "replicated-kv": ("llama", {"num_key_value_heads": 1}, {}),  # 1 KV head, on both ranks
}


def _config(folder, tp: int, **extra) -> EngineConfig:
    # 16-token chunks: the 37-token prompt prefills in three steps beside the others' decode.
    fields = dict(
        model=str(folder),
        log_startup=False,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=8 << 20,
        tensor_parallel_size=tp,
    )
    return EngineConfig(**{**fields, **extra})


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides, _ = CASES[request.param]
    folder = tmp_path_factory.mktemp(f"tiny-tp-{request.param}")
    hf = make_tiny_model(arch, folder, **overrides)
    with torch.no_grad():
        reference = []
        for prompt in PROMPTS:
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            reference.append(out[0, len(prompt) :].tolist())
    loaded = load_model(folder, progress=False)
    one = LLMEngine(_config(folder, 1), parts=build_parts(_config(folder, 1), loaded))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    single = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params)]
    return request.param, folder, reference, single


def test_greedy_ids_equal_transformers_and_one_rank(case):
    name, folder, reference, single = case
    engine = LLMEngine(_config(folder, 2, **CASES[name][2]))
    try:
        assert engine.steps_ahead == (name == "split-llama")
        page = engine.parts.page_format
        kv_heads = 1 if name == "replicated-kv" else 2
        assert (page.tp_size, page.num_kv_heads, page.model_kv_heads) == (2, 1, kv_heads)
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        ids = [o.outputs[0].token_ids for o in outs]
        assert ids == reference
        assert ids == single
        assert_no_leaks(engine)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A TP 1 engine and a TP 2 engine on the tiny Llama, each with a pool of 12 usable blocks
    and a host tier of 8 (a rank's flags size its own pools: a TP 2 rank's record is 256
    bytes, half of the 512 of one rank's): the second batch evicts the first's prefix blocks
    into the tier."""
    folder = tmp_path_factory.mktemp("tiny-tp-pair")
    make_tiny_model("llama", folder)
    engines = []
    for tp in (1, 2):
        block_bytes = 16 * 512 // tp
        sizes = dict(kv_cache_memory_bytes=13 * block_bytes, host_kv_memory_bytes=8 * block_bytes)
        engines.append(LLMEngine(_config(folder, tp, **sizes)))
    yield engines
    for engine in engines:
        engine.close()


def test_prompt_logprobs_equal_one_ranks(pair):
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    one, two = (e.generate([PROMPTS[1]], params)[0] for e in pair)
    assert len(two.prompt_logprobs) == len(PROMPTS[1])
    for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
        assert a.rank == b.rank and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4)


def test_host_tier_blocks_move_on_every_rank(pair):
    """Prompts of 48 tokens (3 full blocks); a burst of others evicts them into the host tier;
    asked again, their blocks come back from it (on both ranks: the same tokens)."""
    first = [[(5 * i + k) % 250 + 10 for i in range(48)] for k in range(2)]
    burst = [[(3 * i + k) % 240 + 12 for i in range(40)] for k in range(3, 6)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    results = []
    for engine in pair:
        runs = [engine.generate(p, params) for p in (first, burst, first)]
        results.append([[o.outputs[0].token_ids for o in run] for run in runs])
        assert engine.info.num_blocks == 12
        assert engine.runner.mover.counts.blocks.get(("host", "loaded"), 0) > 0
        assert_no_leaks(engine)
    assert results[0] == results[1]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_are_sharded_at_block_boundaries(tmp_path, weights):
    """``--weights int8|int4`` quantizes each rank's slices in blocks of 32 inputs: with MLP
    rows of 128 (64 a rank) and 4 heads of 16 (32 inputs a rank for o_proj) every block of
    one rank is a block of the whole model's, so TP 2 gives the quantized TP 1's tokens."""
    make_tiny_model("llama", tmp_path, intermediate_size=128)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = []
    for tp in (1, 2):
        engine = LLMEngine(_config(tmp_path, tp, weights=weights))
        try:
            ids.append([o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)])
            assert weights in engine.parts.model.weights_report
        finally:
            engine.close()
    assert ids[0] == ids[1]
