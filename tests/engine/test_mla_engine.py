"""MLA pages through the engine's paging features (issue 55), on the tiny random DeepSeek-V2
and -V3 checkpoints of ``tests/model/tiny.py`` (context 256), against transformers' greedy
``generate`` on the same weights: prefix-cache hits and ``n > 1`` forks (copy-on-write of the
latent pages) at B = 1, 16 and 64; swap preemption (latent pages to the host swap pool and back);
the host tier (an evicted prefix's latent pages back from host memory). Invariants after every
step, no leaks."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model
from tests.engine.conftest import assert_no_leaks
from tests.model.tiny import make_tiny_model

RECORD_BYTES = 3 * (32 + 8) * 4  # 3 layers x one latent record (rank 32 + rope 8) x fp32
NEW_TOKENS = 12
_rng = random.Random(5)
PROMPT = [_rng.randrange(256) for _ in range(80)]
PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (70, 60, 75, 65)]


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def deepseek(request, tmp_path_factory):
    """``(loaded, greedy)``: the model, and transformers' greedy tokens of a prompt."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, folder, context_len=256)
    cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            with torch.no_grad():
                ids = torch.tensor([prompt])  # the mask given: token 0 is no padding here
                out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)  # fmt: skip
            cache[tuple(prompt)] = out[0, len(prompt) :].tolist()
        return cache[tuple(prompt)]

    return load_model(folder, progress=False), greedy


def make(loaded, **overrides) -> LLMEngine:
    overrides.setdefault("log_startup", False)
    overrides.setdefault("max_model_len", 256)
    config = EngineConfig(**overrides)
    return LLMEngine(config, parts=build_parts(config, loaded))


def run_checked(engine: LLMEngine, prompts, params) -> list[list[list[int]]]:
    """Every sample's tokens of every prompt, all queued at once; the scheduler's invariants
    after every step."""
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out
        engine.scheduler.check_invariants()
    return [done[i] for i in ids]


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_prefix_hits_and_forks_give_transformers_tokens(deepseek, block_size):
    loaded, greedy = deepseek
    engine = make(loaded, block_size=block_size, kv_cache_memory_bytes=1 << 20)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    (cold,) = run_checked(engine, [PROMPT], params)
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == greedy(PROMPT)
    # The same prompt again, three greedy samples: its full blocks hit, the samples fork.
    (hit,) = run_checked(engine, [PROMPT], SamplingParams(max_tokens=NEW_TOKENS, n=3,
                                                          ignore_eos=True))  # fmt: skip
    assert hit.num_cached_tokens == (len(PROMPT) - 1) // block_size * block_size > 0
    assert [c.token_ids for c in hit.outputs] == [greedy(PROMPT)] * 3
    assert_no_leaks(engine)


def test_swap_preemption_carries_latent_pages(deepseek):
    """Four sequences (~330 tokens at their longest) in a pool of 224 slots: preempted ones
    swap their latent pages out and back, and decode on to transformers' tokens."""
    loaded, greedy = deepseek
    engine = make(loaded, block_size=16, kv_cache_memory_bytes=(224 + 16) * RECORD_BYTES,
                  preemption_mode="swap", swap_space_bytes=1 << 20)  # fmt: skip
    outs = run_checked(engine, PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [greedy(p) for p in PROMPTS]
    snap = engine.snapshot()
    assert snap.num_swap_outs > 0 and snap.num_swap_ins == snap.num_swap_outs
    assert snap.swap_out_bytes == snap.num_swapped_blocks_out * 16 * RECORD_BYTES
    assert_no_leaks(engine)
    assert engine.scheduler.swap_space.num_used_blocks == 0


def test_an_evicted_prefix_comes_back_from_the_host_tier(deepseek):
    loaded, greedy = deepseek
    engine = make(loaded, block_size=16, kv_cache_memory_bytes=(112 + 16) * RECORD_BYTES,
                  host_kv_memory_bytes=1 << 20)  # fmt: skip
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    run_checked(engine, [PROMPT], params)
    for other in PROMPTS[:2]:  # each fills the device pool: PROMPT's blocks go to the host
        run_checked(engine, [other], params)
    (again,) = run_checked(engine, [PROMPT], params)
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == greedy(PROMPT)
    assert dict(engine.allocator.stats().tier_hit_tokens)["host"] == 64
    assert_no_leaks(engine)
