"""Partial-block prefix reuse on the real engine (a tiny random Llama, fp32): prompts that share
a prefix ending inside a block reuse it to the token (``--prefix-match-unit 1``) and give the
greedy tokens of an engine with no prefix cache at all, whether the matched block is copied
(its source still in use: the requests run at the same time) or claimed in place (the first
request finished), and through preemption by recompute or swap and ``n > 1`` forks of
sequences holding a copied block. No block leaks afterwards."""

from __future__ import annotations

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts

from .conftest import assert_no_leaks

B = 16
STEM = [(7 * i + 3) % 250 for i in range(37)]  # two full blocks, then 5 tokens into the third
# A fills the third block at once (49 tokens) and diverges from B_ at token 37, inside it.
A = STEM + [251, 252, 253, 254, 255, 249, 248, 247, 246, 245, 244, 243]
B_ = STEM + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
# Logprobs too: a reused KV slot that differs from the reference moves them before a token.
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)


def _engine(model, **overrides) -> LLMEngine:
    overrides.setdefault("log_startup", False)
    overrides.setdefault("max_model_len", 256)
    overrides.setdefault("kv_cache_memory_bytes", 1 << 20)
    config = EngineConfig(**overrides)
    return LLMEngine(config, parts=build_parts(config, model))


def _tokens(engine: LLMEngine, prompts, params=GREEDY) -> list[list[Sample]]:
    outs = engine.generate(prompts, params)
    assert all(o.error is None for o in outs)
    return [[_sample(c) for c in o.outputs] for o in outs]


class Sample:
    """One sample's tokens and logprobs; equal to another within fp32 noise."""

    def __init__(self, token_ids: list[int], logprobs: list[float]) -> None:
        self.token_ids, self.logprobs = token_ids, logprobs

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Sample)
            and self.token_ids == other.token_ids
            and self.logprobs == pytest.approx(other.logprobs, abs=1e-5)
        )

    def __repr__(self) -> str:
        return f"Sample({self.token_ids}, {self.logprobs})"


def _sample(c) -> Sample:
    return Sample(list(c.token_ids), list(c.logprobs or []))


@pytest.fixture(scope="module")
def reference(tiny_long):
    """Each prompt alone on an engine without a prefix cache."""
    engine = _engine(tiny_long, policy=f"paged-nocache:{B}")
    return {name: _tokens(engine, [p])[0] for name, p in (("A", A), ("B", B_))}


def test_one_after_the_other_a_prefix_ending_inside_a_block_is_reused_to_the_token(
    tiny_long, reference
):
    engine = _engine(tiny_long, block_size=B, prefix_match_unit=1)
    assert _tokens(engine, [A]) == [reference["A"]]
    (out,) = engine.generate([B_], GREEDY)
    assert [_sample(c) for c in out.outputs] == reference["B"]
    # Reused to the token: the 37 shared tokens, 5 of them from inside the third block, copied
    # (A's third block is no leaf: A's kept partial tail follows it).
    assert out.num_cached_tokens == len(STEM)
    assert out.num_partial_cached_tokens == out.num_prefix_copied_tokens == len(STEM) % B
    assert_no_leaks(engine)


def test_a_follow_up_turn_claims_the_previous_turns_partial_tail(tiny_long, reference):
    """The next turn of A's conversation (A, its answer, new text) reuses A's last block, only
    partly filled when A finished: claimed in place, nothing copied, all but A's last token
    (whose KV was never computed) reused."""
    engine = _engine(tiny_long, block_size=B, prefix_match_unit=1)
    (first,) = engine.generate([A], GREEDY)
    answer = first.outputs[0].token_ids
    follow_up = A + answer + [9, 8, 7]
    want = _tokens(_engine(tiny_long, policy=f"paged-nocache:{B}"), [follow_up])
    (out,) = engine.generate([follow_up], GREEDY)
    assert [_sample(c) for c in out.outputs] == want[0]
    assert out.num_cached_tokens == len(A) + len(answer) - 1
    assert out.num_partial_cached_tokens == out.num_cached_tokens % B > 0
    assert out.num_prefix_copied_tokens == 0
    s = engine.allocator.stats()
    assert s.num_partial_claims == 1 and s.partial_copied_tokens == 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "one-step-ahead"])
def test_at_the_same_time_the_block_is_copied_and_both_texts_are_the_reference(
    tiny_long, reference, ahead
):
    """B arrives while A decodes: A's third block is in use, so B's 5 tokens of it are copied
    before B's forward pass; scheduling one step ahead too (the copy of step N + 1 still runs
    after step N's forward pass wrote its source)."""
    engine = _engine(tiny_long, block_size=B, prefix_match_unit=1, async_scheduling=ahead)
    engine.add_request(A, GREEDY, request_id="a")
    engine.step()  # A's prompt is computed; it decodes on while B arrives
    engine.add_request(B_, GREEDY, request_id="b")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert _sample(done["a"].outputs[0]) == reference["A"][0]
    assert _sample(done["b"].outputs[0]) == reference["B"][0]
    assert done["b"].num_cached_tokens == len(STEM)
    assert done["b"].num_prefix_copied_tokens == len(STEM) % B  # A still held the block
    s = engine.stats()
    assert s.partial_hits == 1 and s.partial_claims == 0
    assert s.prefix_copy_bytes == (len(STEM) % B) * engine.info.record_bytes
    assert_no_leaks(engine)


def test_whole_blocks_lose_the_partial_block(tiny_long, reference):
    """The same run with the default unit (the block size): the hit stops at a block edge."""
    engine = _engine(tiny_long, block_size=B)
    _tokens(engine, [A])
    (out,) = engine.generate([B_], GREEDY)
    assert [_sample(c) for c in out.outputs] == reference["B"]
    assert out.num_cached_tokens == len(STEM) // B * B
    assert engine.allocator.stats().num_partial_hits == 0


def test_n_greater_than_one_forks_a_sequence_holding_a_copied_block(tiny_long):
    params = SamplingParams(max_tokens=6, ignore_eos=True, n=3, logprobs=0)
    want = _tokens(_engine(tiny_long, policy=f"paged-nocache:{B}"), [B_], params)
    engine = _engine(tiny_long, block_size=B, prefix_match_unit=1)
    engine.add_request(A, GREEDY, request_id="a")
    engine.step()
    assert _tokens(engine, [B_], params) == want
    assert engine.stats().partial_hits == 1
    while engine.has_unfinished():  # A, still decoding
        engine.step()
    assert_no_leaks(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_of_sequences_holding_copied_blocks(tiny_long, mode):
    """A pool of 12 usable blocks for four prompts of 45 to 49 tokens decoding 24 tokens each:
    sequences whose third block was copied from A's (running) are preempted and recomputed
    (matching the prefix again) or swapped out and back."""
    prompts = [A] + [STEM + [100 + i] * 8 for i in range(3)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0)
    want = _tokens(_engine(tiny_long, policy=f"paged-nocache:{B}"), prompts, params)
    swap = {"preemption_mode": "swap", "swap_space_bytes": 1 << 20} if mode == "swap" else {}
    engine = _engine(
        tiny_long, block_size=B, prefix_match_unit=1, kv_cache_memory_bytes=13 * B * 512, **swap
    )
    engine.add_request(prompts[0], params, request_id="first")
    engine.step()  # its blocks are cached and in use: the others copy its partial block
    outs = {o.request_id: o for o in engine.generate(prompts[1:], params)}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    got = [outs["first"]] + [o for k, o in sorted(outs.items()) if k != "first"]
    assert [[_sample(o.outputs[0])] for o in got] == want
    s = engine.stats()
    assert s.preemptions > 0 and s.partial_hits > 0
    if mode == "swap":
        assert s.swap_outs > 0
    assert_no_leaks(engine)
