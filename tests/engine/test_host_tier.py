"""The host tier in the engine: a prefix evicted from the device pool comes back from host
memory instead of being recomputed, and greedy tokens equal a cold run and a device hit, for
block sizes 1, 16 and 64. Invariants (allocator and host index) after every step.

A tiny random Llama with a 512-token context; prompts are token ids (their text means nothing).
"""

from __future__ import annotations

import random

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.errors import UsageError
from pagedkv.kvcache.tiers.host_index import HostTierIndex

from .conftest import assert_no_leaks

RECORD_BYTES = 512  # the tiny llama: 2 layers x 2 KV heads x 16 dims x K,V x fp32
POOL_TOKENS = 192  # usable device slots: one long prompt fills most of it
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
_rng = random.Random(7)
PROMPT = [_rng.randrange(256) for _ in range(130)]
# Two distinct long prompts: each takes most of the pool, so that after both no block of
# PROMPT is left on the device (the second evicts what the first left, oldest first).
DISTRACTORS = [[_rng.randrange(256) for _ in range(150)] for _ in range(2)]


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    from pagedkv.model import load_model
    from tests.model import tiny

    folder = tmp_path_factory.mktemp("tiny-llama-host-tier")
    tiny.make_tiny_model("llama", folder, context_len=512)
    return load_model(folder, progress=False)


def make(tiny_long, block_size: int, host_bytes: int) -> LLMEngine:
    config = EngineConfig(
        block_size=block_size,
        kv_cache_memory_bytes=(POOL_TOKENS + block_size) * RECORD_BYTES,  # + the null block
        host_kv_memory_bytes=host_bytes,
        max_model_len=256,
        log_startup=False,
    )
    return LLMEngine(config, parts=build_parts(config, tiny_long))


def hits(engine: LLMEngine) -> dict[str, int]:
    return dict(engine.allocator.stats().tier_hit_tokens)


def run(engine: LLMEngine, prompt: list[int]):
    """One request, stepped by hand with every invariant checked after each step."""
    request_id = engine.add_request(prompt, GREEDY)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
        engine.allocator.check_invariants()
        for tier in engine.allocator.tiers.tiers if engine.allocator.tiers else ():
            if isinstance(tier, HostTierIndex):
                tier.check_invariants()
    assert final is not None and final.error is None
    return final


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_host_hit_gives_the_tokens_of_a_cold_run(tiny_long, block_size):
    cold = run(make(tiny_long, block_size, 0), PROMPT)
    assert cold.num_cached_tokens == 0

    engine = make(tiny_long, block_size, 1 << 20)
    first = run(engine, PROMPT)
    assert first.outputs[0].token_ids == cold.outputs[0].token_ids
    device = run(engine, PROMPT)  # still on the device: a device hit
    expected_hit = (len(PROMPT) - 1) // block_size * block_size
    assert device.num_cached_tokens == expected_hit
    assert device.outputs[0].token_ids == cold.outputs[0].token_ids
    assert hits(engine) == {"device": expected_hit, "host": 0}

    for d in DISTRACTORS:  # push every block of PROMPT off the device, into the host tier
        run(engine, d)
    assert not any(engine.allocator.pool.lookup(h) for h in _hashes(engine, PROMPT))
    before = hits(engine)
    host = run(engine, PROMPT)
    after = hits(engine)
    assert after["host"] - before["host"] == expected_hit  # every hit block came from the host
    assert after["device"] == before["device"]  # none from the device
    assert host.num_cached_tokens == expected_hit  # usage.cached_tokens counts every tier
    assert host.outputs[0].token_ids == cold.outputs[0].token_ids
    snap = engine.snapshot()
    assert snap.tier_moves is not None
    assert snap.tier_moves.blocks[("host", "loaded")] == expected_hit // block_size
    assert snap.tier_moves.blocks[("host", "offloaded")] >= expected_hit // block_size
    rows = dict(engine.stats().rows())
    assert rows["prefix-hit tokens by tier"] == f"device {after['device']}, host {after['host']}"
    assert_no_leaks(engine)


def _hashes(engine: LLMEngine, prompt: list[int]) -> list[bytes]:
    from pagedkv.kvcache import HashExtraKeys, hash_blocks, root_hash

    bs = engine.allocator.block_size
    return hash_blocks(prompt, bs, root_hash(HashExtraKeys()), extra=HashExtraKeys())[
        : (len(prompt) - 1) // bs
    ]


def test_without_a_host_tier_the_evicted_prefix_is_recomputed(tiny_long):
    engine = make(tiny_long, 16, 0)
    run(engine, PROMPT)
    for d in DISTRACTORS:
        run(engine, d)
    assert run(engine, PROMPT).num_cached_tokens == 0
    assert engine.allocator.stats().tier_hit_tokens == ()
    assert engine.allocator.tiers is None and not engine.runner.mover.has_tiers


def test_bad_host_kv_memory_is_one_usage_error(tiny_long):
    with pytest.raises(UsageError, match="host_kv_memory_bytes must be an integer >= 0"):
        EngineConfig(host_kv_memory_bytes=-1)
    with pytest.raises(UsageError, match="holds no KV block"):
        make(tiny_long, 16, 100)
    config = EngineConfig(policy="sglang", host_kv_memory_bytes=1 << 20, log_startup=False)
    with pytest.raises(UsageError, match="needs a paged policy"):
        build_parts(config, tiny_long)


def test_startup_prints_the_host_tier(tiny_long):
    config = EngineConfig(host_kv_memory_bytes=1 << 20, max_model_len=256, log_startup=False)
    report = build_parts(config, tiny_long).startup_report
    assert "pagedkv: host KV tier 128 blocks x 16 tokens = 2048 slots, 1.0 MiB" in report


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--host-kv-memory", "12XB"], "--host-kv-memory: expected a size"),
        (["--host-kv-memory", "1GiB", "--policy", "sglang"], "needs a paged policy"),
        (["--host-kv-memory", "100"], "holds no KV block"),
    ],
)
def test_bad_host_kv_memory_flag_is_one_line(capsys, argv, message):
    from pagedkv import cli

    assert cli.main(["generate", *argv, "hi"]) == 2  # refused before the weights load
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_batches_under_pressure_match_a_roomy_pool(tiny_long):
    """Rounds of batches over shared stems in a pool too small for them: evictions, offloads,
    host loads (and preemptions) inside one step, among many sequences; every output equals a
    run in a pool with room for everything, and nothing leaks."""
    rng = random.Random(3)
    stems = [[rng.randrange(256) for _ in range(64)] for _ in range(3)]
    prompts = [stems[i % 3] + [rng.randrange(256) for _ in range(10 + 7 * i)] for i in range(9)]
    config = EngineConfig(
        block_size=16, kv_cache_memory_bytes=4 << 20, max_model_len=256, log_startup=False
    )
    roomy = LLMEngine(config, parts=build_parts(config, tiny_long))
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, GREEDY)]
    engine = make(tiny_long, 16, 1 << 20)
    for rnd in range(3):
        order = list(range(len(prompts)))
        rng.shuffle(order)
        outs = engine.generate([prompts[i] for i in order], GREEDY)
        for i, out in zip(order, outs, strict=True):
            assert out.error is None and out.outputs[0].token_ids == want[i], (rnd, i)
        engine.allocator.check_invariants()
    assert hits(engine)["host"] > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("runs", [True, False])
def test_copy_rows_equals_a_row_by_row_copy(runs):
    """The batched copy (slice copies for long runs, else gather/scatter) moves exactly the
    rows a loop would, whatever the order of the pairs."""
    import torch

    from pagedkv.engine.kv.host_tier import copy_rows

    rng = random.Random(1 + runs)
    torch.manual_seed(2)
    for _ in range(50):
        dst = [(torch.randn(40, 2, 3), torch.randn(40, 2, 3)) for _ in range(2)]
        src = [(torch.randn(50, 2, 3), torch.randn(50, 2, 3)) for _ in range(2)]
        k = rng.randint(1, 30)
        if runs:  # two consecutive runs on both sides, shuffled
            d0, s0 = rng.randint(0, 40 - k), rng.randint(0, 50 - k)
            pairs = [(d0 + i, s0 + (i + k // 2) % k) for i in range(k)]
            rng.shuffle(pairs)
        else:
            pairs = list(zip(rng.sample(range(40), k), rng.sample(range(50), k), strict=True))
        want = [(a.clone(), b.clone()) for a, b in dst]
        for (wa, wb), (sa, sb) in zip(want, src, strict=True):
            for d, s in pairs:
                wa[d], wb[d] = sa[s], sb[s]
        copy_rows(dst, [d for d, _ in pairs], src, [s for _, s in pairs])
        for (a, b), (wa, wb) in zip(dst, want, strict=True):
            assert torch.equal(a, wa) and torch.equal(b, wb)
