"""Swap preemption executed by the engine: a preempted sequence's KV goes to the host swap pool
and comes back; greedy tokens equal those of a run without preemption and of a recompute run,
for every allocator and block size the invariance tests cover. The scheduler's invariants
(allocator, swap space, queues) hold after every step, and nothing leaks.

A tiny random Llama with a 512-token context (so that sequences outgrow a 128-token block and
B = 128 preempts too); prompts are token ids (the model's text means nothing).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.errors import UsageError

from .conftest import assert_no_leaks

RECORD_BYTES = 512  # the tiny llama: 2 layers x 2 KV heads x 16 dims x K,V x fp32
MAX_TOKENS = 40
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
_rng = random.Random(12)
# Prompts of 100-120 tokens: with 40 new tokens each crosses a 128-token block boundary.
PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (110, 100, 120, 105)]

# (policy, block_size, KV pool in tokens): pools far too small for the four sequences at once
# (620 tokens), so running sequences are preempted; the reserved baseline admits two regions
# and never grows, so it never preempts (it checks that swap mode changes nothing there).
CASES = [
    ("vllm", 1, 250),
    ("vllm", 16, 304),
    ("vllm", 128, 384),  # 2 usable blocks (+ the null block)
    ("sglang", None, 250),
    ("radix:16", None, 304),
    ("reserved", None, 512),
    ("llamacpp", None, 250),
]
MAX_MODEL_LEN = 256


def make(loaded, **overrides) -> LLMEngine:
    overrides.setdefault("log_startup", False)
    overrides.setdefault("max_model_len", MAX_MODEL_LEN)
    config = EngineConfig(**overrides)
    return LLMEngine(config, parts=build_parts(config, loaded))


def run_checked(engine: LLMEngine, prompts=PROMPTS) -> list[list[int]]:
    """Greedy tokens of every prompt, all queued at once; the scheduler's invariants after
    every step."""
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def reference(tiny_long):
    """Each prompt alone in a large pool (no preemption): paged B = 16."""
    engine = make(tiny_long, kv_cache_memory_bytes=4 << 20)
    tokens = [run_checked(engine, [p])[0] for p in PROMPTS]
    assert engine.stats().preemptions == 0
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


def _pool(policy, block_size, tokens, **kw):
    return dict(
        policy=policy,
        block_size=block_size,
        kv_cache_memory_bytes=tokens * RECORD_BYTES,
        **kw,
    )


@pytest.mark.parametrize("policy, block_size, pool_tokens", CASES)
def test_swap_gives_the_tokens_of_no_preemption_and_of_recompute(
    tiny_long, reference, policy, block_size, pool_tokens
):
    recompute = make(tiny_long, **_pool(policy, block_size, pool_tokens))
    assert run_checked(recompute) == reference
    swap = make(
        tiny_long,
        **_pool(policy, block_size, pool_tokens, preemption_mode="swap", swap_space_bytes=1 << 20),
    )
    assert run_checked(swap) == reference
    snap = swap.snapshot()
    if policy == "reserved":  # admits whole regions: nothing to preempt
        assert recompute.stats().preemptions == 0 and snap.num_swap_outs == 0
    else:
        assert recompute.stats().preemptions > 0
        assert snap.num_swap_outs > 0 and snap.num_swap_ins == snap.num_swap_outs
        assert snap.num_swapped_blocks_out >= snap.num_swapped_blocks_in > 0
        block_bytes = swap.runner.swap_pool.block_bytes
        assert snap.swap_out_bytes == snap.num_swapped_blocks_out * block_bytes
        assert snap.swap_in_bytes == snap.num_swapped_blocks_in * block_bytes
        assert snap.num_swap_fallbacks == 0
        assert swap.stats().swap_outs == snap.num_swap_outs
        # Swapping kept the computed tokens: less recomputed than under recompute.
        assert swap.scheduler.num_recomputed_tokens < recompute.scheduler.num_recomputed_tokens
    assert_no_leaks(swap)
    assert swap.scheduler.swap_space.num_used_blocks == 0


def test_a_full_swap_space_falls_back_to_recompute(tiny_long, reference):
    # Room for one 16-token block: every victim holds more, so each one is recomputed.
    engine = make(
        tiny_long, **_pool("vllm", 16, 304, preemption_mode="swap", swap_space_bytes=16 * 512)
    )
    assert engine.runner.swap_pool.num_blocks == 1
    assert run_checked(engine) == reference
    snap = engine.snapshot()
    assert snap.num_swap_fallbacks > 0 and snap.num_preemptions > 0
    assert snap.num_swap_outs == snap.swap_out_bytes == 0
    assert_no_leaks(engine)


def test_swap_with_n_samples_and_a_prefix_hit(tiny_long):
    """Forked samples (copy-on-write) and shared prefix blocks swap too: same tokens as a
    large pool."""
    prompts = [PROMPTS[0], PROMPTS[0][:80] + PROMPTS[1][:30], PROMPTS[2]]
    params = SamplingParams(max_tokens=30, n=2, temperature=1.0, seed=7, ignore_eos=True)

    def run(**kw):
        engine = make(tiny_long, **kw)
        outs = engine.generate(prompts, params)
        engine.scheduler.check_invariants()
        assert_no_leaks(engine)
        return [[c.token_ids for c in o.outputs] for o in outs], engine

    want, _ = run(kv_cache_memory_bytes=4 << 20)
    got, engine = run(**_pool("vllm", 16, 320, preemption_mode="swap", swap_space_bytes=1 << 20))
    assert got == want
    assert engine.snapshot().num_swap_outs > 0


def test_startup_prints_the_host_swap_pool(tiny_long, capsys):
    make(tiny_long, log_startup=True, preemption_mode="swap", swap_space_bytes=1 << 20)
    err = capsys.readouterr().err
    assert "host swap pool 128 blocks x 16 tokens = 2048 slots, 1.0 MiB" in err


def test_swap_space_below_one_block_is_a_usage_error(tiny_long):
    # 16 tokens x 512 bytes = 8192 bytes per block.
    with pytest.raises(UsageError, match="holds no KV block of 16 tokens") as info:
        make(tiny_long, preemption_mode="swap", swap_space_bytes=8191)
    assert info.value.param == "swap_space"
    make(tiny_long, preemption_mode="swap", swap_space_bytes=8192)


def test_kv_survives_the_round_trip_bit_for_bit(tiny_long):
    """After a run with swaps, the swapped-in blocks held exactly what was swapped out: checked
    on the pools directly with a batch of hand-made copies."""
    engine = make(tiny_long, preemption_mode="swap", swap_space_bytes=1 << 20)
    runner = engine.runner
    for k, v in runner.kv_caches:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    pool = runner.swap_pool
    pool.swap_out(runner.kv_caches, [(3, 0), (5, 1), (3, 2)])
    pool.swap_in(runner.kv_caches, [(1, 7), (0, 9)])
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        for now, was in ((k, k0), (v, v0)):
            assert torch.equal(now[7], was[5]) and torch.equal(now[9], was[3])
            assert torch.equal(now[:7], was[:7]) and torch.equal(now[8], was[8])


def test_containment_reruns_do_not_swap_twice(tiny_long, reference):
    """A step that swaps in and then fails as a whole is re-run entry by entry
    (engine/step/containment.py): the blocks move once, and every request still gets its tokens."""
    engine = make(
        tiny_long, **_pool("vllm", 16, 304, preemption_mode="swap", swap_space_bytes=1 << 20)
    )
    real = engine.loop._forward_and_draw
    failed_steps = []

    def flaky(batch):
        draws = real(batch)
        if batch.swap_in and len(batch.seqs) > 1 and not failed_steps:
            failed_steps.append(batch.step)
            raise RuntimeError("injected after the batch ran")
        return draws

    engine.loop._forward_and_draw = flaky
    assert run_checked(engine) == reference
    assert failed_steps, "no step swapped in with company: the test forced nothing"
    pool, sched = engine.runner.swap_pool, engine.scheduler
    assert pool.blocks_in == sched.num_swapped_blocks_in > 0
    assert pool.blocks_out == sched.num_swapped_blocks_out
    assert engine.snapshot().num_failed_requests == 0
