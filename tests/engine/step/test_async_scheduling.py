"""Scheduling one step ahead (``engine/step/loop.py``) gives the synchronous engine's tokens.

The same requests run twice, the engine synchronous and one step ahead: greedy and seeded
sampling, ``n > 1`` (forks), stop strings, logprobs, penalties, structured output, prefix hits,
preemption (recompute and swap) on every allocator, an abort between steps; the native CPU
kernels and the Triton backend under its interpreter. Every run checks the scheduler's
invariants after every step and leaks nothing; an ahead engine really scheduled ahead (it
computed placeholders).
"""

from __future__ import annotations

import json
import random

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.engine.structured.spec import StructuredOutput

from ..conftest import assert_no_leaks
from ..test_swap_engine import CASES, MAX_MODEL_LEN, PROMPTS, RECORD_BYTES

_rng = random.Random(3)
SHARED = [_rng.randrange(256) for _ in range(40)]  # a prefix several requests share


def make(loaded, ahead: bool, **overrides) -> LLMEngine:
    overrides.setdefault("log_startup", False)
    overrides.setdefault("max_model_len", MAX_MODEL_LEN)
    config = EngineConfig(async_scheduling=ahead, **overrides)
    return LLMEngine(config, parts=build_parts(config, loaded))


def run(engine: LLMEngine, requests, abort_after: dict[int, int] | None = None) -> dict:
    """Every (prompt, params) queued at once; {index: [tokens of each sample]} of the ones
    that finished, the invariants checked after every step. ``abort_after``: request index ->
    the step after which it is aborted."""
    ids = [engine.add_request(p, params) for p, params in requests]
    done, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[ids.index(out.request_id)] = [c.token_ids for c in out.outputs]
        steps += 1
        for index, step in (abort_after or {}).items():
            if step == steps:
                engine.abort(ids[index])
        engine.scheduler.check_invariants()
    assert_no_leaks(engine)
    return done


def both(loaded, requests, abort_after=None, **config) -> tuple[dict, dict]:
    sync = make(loaded, False, **config)
    ahead = make(loaded, True, **config)
    placeholders = []
    schedule = ahead.scheduler.schedule

    def counting():  # the tokens the ahead engine computed before they were drawn
        batch = schedule()
        placeholders.append(sum(item.seq.has_placeholder for item in batch.seqs))
        return batch

    ahead.scheduler.schedule = counting
    got = run(sync, requests, abort_after), run(ahead, requests, abort_after)
    assert sum(placeholders) > 0, "the ahead engine never scheduled ahead"
    return got


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_greedy_seeded_and_forked_samples_equal_the_synchronous_engine(tiny_long):
    requests = [
        (PROMPTS[0], GREEDY),
        (PROMPTS[1], SamplingParams(max_tokens=20, temperature=1.0, top_k=40, seed=5)),
        (PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=9, n=3)),
        (SHARED + [1, 2], GREEDY),
        (SHARED + [3], SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3)),
        (
            SHARED + [4, 5],
            SamplingParams(
                max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True
            ),
        ),  # fmt: skip
        (PROMPTS[3], SamplingParams(max_tokens=1, ignore_eos=True)),  # done at its first token
    ]
    sync, ahead = both(tiny_long, requests, kv_cache_memory_bytes=4 << 20,
                       max_num_batched_tokens=64)  # fmt: skip
    assert ahead == sync and len(sync) == len(requests)
    assert len(sync[2]) == 3 and len({tuple(t) for t in sync[2]}) > 1


def test_prefix_hits_see_only_known_tokens(tiny_long):
    """A block completed by a token drawn one step ahead enters the prefix cache once the token
    is known: a later request sharing the whole generated prefix hits it in both engines."""
    first = (SHARED, SamplingParams(max_tokens=24, ignore_eos=True))
    engines = {}
    for ahead in (False, True):
        engine = make(tiny_long, ahead, kv_cache_memory_bytes=4 << 20, block_size=8)
        (tokens,) = run(engine, [first])[0]
        follow = (SHARED + tokens + [7], GREEDY)
        engines[ahead] = (run(engine, [follow])[0], engine.stats().prefix_hit_tokens)
    assert engines[True] == engines[False]
    assert engines[True][1] >= 56  # the 64-token sequence's 7 full blocks, generated included


@pytest.mark.parametrize("policy, block_size, pool_tokens", CASES)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_synchronous_tokens(tiny_long, policy, block_size, pool_tokens, mode):
    requests = [(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS]
    config = dict(policy=policy, block_size=block_size,
                  kv_cache_memory_bytes=pool_tokens * RECORD_BYTES, preemption_mode=mode)  # fmt: skip
    if mode == "swap":
        config["swap_space_bytes"] = 1 << 20
    sync, ahead = both(tiny_long, requests, **config)
    assert ahead == sync


def test_an_abort_between_steps_changes_nobody_else(tiny_long):
    requests = [(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in PROMPTS]
    sync, ahead = both(tiny_long, requests, abort_after={1: 3},
                       kv_cache_memory_bytes=4 << 20)  # fmt: skip
    assert 1 not in sync and ahead == sync


def test_stop_strings_and_eos_end_where_the_synchronous_engine_ends(embedded):
    """The embedded model's text: EOS and a stop string found one step after the token that
    ends them; the ahead engine's extra token is dropped."""
    requests = [
        ("1, 2, 3, 4,", SamplingParams(max_tokens=24, stop=("9",))),
        ("Write one short sentence about the sea.", SamplingParams(max_tokens=48)),
        (
            "Count: a, b, c,",
            SamplingParams(max_tokens=16, stop=(" f",), seed=3, temperature=0.7),
        ),  # fmt: skip
    ]
    sync, ahead = both(embedded, requests, kv_cache_memory_bytes=64 << 20, max_model_len=512)
    assert ahead == sync
    assert len(sync[0][0]) < 24  # the stop string ended it


def test_structured_output_follows_the_grammar_one_step_ahead(embedded):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    structured = StructuredOutput("json", json.dumps(schema))
    params = SamplingParams(max_tokens=40, structured=structured)
    requests = [("Give a JSON object with a = 1.", params), ("Reply with JSON.", params)]
    sync, ahead = both(embedded, requests, kv_cache_memory_bytes=64 << 20, max_model_len=512)
    assert ahead == sync


def test_the_triton_backend_one_step_ahead(tiny_long):
    """Placeholders read from the previous step's draws on the Triton kernels (interpreted)."""
    requests = [(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in PROMPTS[:2]]
    requests.append((PROMPTS[2], SamplingParams(max_tokens=6, temperature=1.0, seed=4, n=2)))
    sync, ahead = both(tiny_long, requests, attention_backend="triton",
                       kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=64)  # fmt: skip
    assert ahead == sync


def test_a_draw_failure_one_step_ahead_fails_only_its_request(tiny_long, monkeypatch):
    """The containment of the synchronous engine, one step ahead: a request whose draws raise
    fails alone; the others get their tokens (``containment.py``)."""
    import pagedkv.engine.step.draws as sample_step

    poison = SamplingParams(max_tokens=12, temperature=1.0, seed=666, ignore_eos=True)
    real_draw = sample_step.draw

    def draw(logits, params, gens, tokens=None, matchers=None):
        if any(p.seed == 666 for p in params):
            raise RuntimeError("injected sampler failure")
        return real_draw(logits, params, gens, tokens, matchers)

    requests = [(PROMPTS[0], GREEDY), (PROMPTS[1], poison), (PROMPTS[2], GREEDY)]
    clean = run(make(tiny_long, False, kv_cache_memory_bytes=4 << 20), requests[::2])
    monkeypatch.setattr(sample_step, "draw", draw)
    engine = make(tiny_long, True, kv_cache_memory_bytes=4 << 20)
    ids = [engine.add_request(p, params) for p, params in requests]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.scheduler.check_invariants()
    assert_no_leaks(engine)
    assert outs[ids[1]].error and "injected sampler failure" in outs[ids[1]].error
    assert [outs[ids[0]].outputs[0].token_ids, outs[ids[2]].outputs[0].token_ids] == [
        clean[0][0], clean[1][0]]  # fmt: skip
