"""Prompt log-probabilities against transformers on the same weights: every prompt token after
the first gets transformers' log-softmax value, rank and top-k, whether the prompt runs in one
prefill or in chunks, beside other requests, after a prefix-cache warm-up (scored uncached:
identical to a cold run), after preemption, and with n > 1. No block leaks afterwards."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.errors import UsageError

from .conftest import assert_no_leaks

_rng = random.Random(7)
PROMPT = [_rng.randrange(256) for _ in range(70)]
OTHER = [_rng.randrange(256) for _ in range(40)]
K = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pagedkv.model import load_model
    from tests.model import tiny

    folder = tmp_path_factory.mktemp("tiny-llama-prompt-logprobs")
    hf = tiny.make_tiny_model("llama", folder, context_len=256)
    return load_model(folder, progress=False), hf


@pytest.fixture(scope="module")
def expected(tiny):
    """transformers' log-softmax over the whole prompt, computed independently in float64."""
    _, hf = tiny
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0].double()
    return logits.log_softmax(dim=-1)


def make(tiny, **overrides) -> LLMEngine:
    overrides.setdefault("block_size", 16)
    config = EngineConfig(log_startup=False, max_model_len=256, **overrides)
    return LLMEngine(config, parts=build_parts(config, tiny[0]))


def check_scores(out, expected) -> None:
    scores = out.prompt_logprobs
    assert scores is not None and len(scores) == len(PROMPT)
    assert scores[0] is None  # nothing predicts the first token
    for i in range(1, len(PROMPT)):
        row = expected[i - 1]
        s = scores[i]
        assert s is not None, i
        assert s.logprob == pytest.approx(float(row[PROMPT[i]]), abs=1e-4), i
        assert s.rank == int((row > row[PROMPT[i]]).sum()) + 1, i
        top_ids = row.topk(K).indices.tolist()
        assert [t for t, _ in s.top] == top_ids, i
        for t, lp in s.top:
            assert lp == pytest.approx(float(row[t]), abs=1e-4)


PARAMS = SamplingParams(max_tokens=3, prompt_logprobs=K, ignore_eos=True)


def test_one_prefill_matches_transformers(tiny, expected):
    engine = make(tiny)
    (out,) = engine.generate([PROMPT], PARAMS)
    check_scores(out, expected)
    assert out.num_cached_tokens == 0
    assert_no_leaks(engine)


def test_chunked_prefill_beside_other_requests(tiny, expected):
    # 24 tokens a step: the prompt is scored in chunks that end mid-block.
    engine = make(tiny, max_num_batched_tokens=24)
    outs = engine.generate([OTHER, PROMPT, OTHER], [SamplingParams(max_tokens=5), PARAMS,
                                                    SamplingParams(max_tokens=2)])  # fmt: skip
    check_scores(outs[1], expected)
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    assert_no_leaks(engine)


def test_a_warm_prefix_cache_is_not_used_for_scored_positions(tiny, expected):
    engine = make(tiny)
    (warm,) = engine.generate([PROMPT], SamplingParams(max_tokens=1))
    (again,) = engine.generate([PROMPT], SamplingParams(max_tokens=1))
    assert again.num_cached_tokens >= 64  # the cache holds the prompt's blocks...
    (scored,) = engine.generate([PROMPT], PARAMS)
    assert scored.num_cached_tokens == 0  # ...but a scored prompt is computed, not reused
    check_scores(scored, expected)
    (cold,) = make(tiny).generate([PROMPT], PARAMS)
    assert scored.prompt_logprobs == cold.prompt_logprobs
    assert scored.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_no_leaks(engine)


def test_recomputed_after_preemption(tiny, expected):
    # A pool of 11 blocks (+ null) admits two 70-token prompts (5 blocks each) but cannot grow
    # both: the later request is preempted, and its prompt recomputed and scored again.
    cfg = tiny[0][0]
    record_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, fp32
    engine = make(tiny, kv_cache_memory_bytes=12 * 16 * record_bytes)
    long = SamplingParams(max_tokens=60, prompt_logprobs=K, ignore_eos=True)
    outs = engine.generate([PROMPT, PROMPT], [long, long])
    assert engine.scheduler.num_preemptions > 0
    for out in outs:
        check_scores(out, expected)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert_no_leaks(engine)


def test_n_samples_share_one_scoring(tiny, expected):
    engine = make(tiny)
    params = SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=1, prompt_logprobs=0)
    (out,) = engine.generate([PROMPT], params)
    assert len(out.outputs) == 3
    assert all(s is None or s.top == [] for s in out.prompt_logprobs)
    got = [s.logprob for s in out.prompt_logprobs[1:]]
    want = [float(expected[i - 1][PROMPT[i]]) for i in range(1, len(PROMPT))]
    assert got == pytest.approx(want, abs=1e-4)
    assert_no_leaks(engine)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_is_refused(bad):
    with pytest.raises(UsageError) as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.param == "prompt_logprobs"
