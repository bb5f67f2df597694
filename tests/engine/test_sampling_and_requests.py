"""n > 1 by copy-on-write forks, seeded sampling, stop strings, logprobs, abort, bad input."""

from __future__ import annotations

import math

import pytest

from pagedkv.engine import EngineConfig, SamplingParams
from pagedkv.errors import UsageError

from .conftest import assert_no_leaks

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def test_n4_shares_prompt_blocks_and_matches_independent_runs(make_engine):
    engine = make_engine(block_size=4)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, n=4)
    request_id = engine.add_request(PROMPT, params)
    engine.step()  # prefill + first tokens of all four samples; the children fork now
    parent = engine._registry.by_id[request_id].seq_of(0)
    full_blocks = list(engine.allocator.block_table(parent))[: parent.num_prompt_tokens // 4]
    assert full_blocks
    refs = engine.allocator.pool.ref_counts
    assert [refs[b] for b in full_blocks] == [4] * len(full_blocks)  # one copy, four owners
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert_no_leaks(engine)
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) > 1, "four seeds gave four identical samples"
    alone = make_engine(block_size=4)
    for i in range(4):
        one = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234 + i)
        (res,) = alone.generate([PROMPT], one)
        assert res.outputs[0].token_ids == samples[i], f"sample {i} differs from its own run"


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=50, seed=7)
    engine = make_engine()
    (a,) = engine.generate([PROMPT], params)
    batch = engine.generate([PROMPT, "Another prompt entirely", "And a third"], params)
    assert batch[0].outputs[0].token_ids == a.outputs[0].token_ids


def test_stop_string_cuts_text_and_frees_blocks(make_engine):
    engine = make_engine()
    (free_run,) = engine.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12))
    text = free_run.outputs[0].text
    assert "7" in text, text
    (out,) = engine.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12, stop=("7",)))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.text == text[: text.index("7")]
    assert len(c.token_ids) < len(free_run.outputs[0].token_ids)
    assert_no_leaks(engine)


def test_logprobs_are_log_probabilities(make_engine):
    engine = make_engine()
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=5, logprobs=3))
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 5
    for token, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
        assert lp <= 0 and len(top) == 3
        assert top[0][0] == token and math.isclose(top[0][1], lp, abs_tol=1e-5)  # greedy
        assert sum(math.exp(v) for _, v in top) <= 1 + 1e-5


def test_abort_frees_blocks_at_once(make_engine):
    engine = make_engine()
    keep = engine.add_request(PROMPT, SamplingParams(max_tokens=6))
    drop = engine.add_request("Tell me everything about", SamplingParams(max_tokens=50))
    engine.step()
    used = engine.allocator.stats().num_used_blocks
    assert engine.abort(drop)
    assert engine.allocator.stats().num_used_blocks < used
    assert not engine.abort(drop)  # already gone
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [keep]
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -5}, {"n": 0},
     {"n": 10_000}, {"logprobs": 999}, {"temperature": 1e9}, {"stop": ("",)}],
)  # fmt: skip
def test_absurd_sampling_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_prompts_get_one_error_each_and_others_carry_on(make_engine):
    engine = make_engine(max_model_len=64)
    outs = engine.generate(
        ["Hello there", "", "word " * 200, [], "General Kenobi"], SamplingParams(max_tokens=4)
    )
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert "empty" in outs[1].error and "exceeds the context" in outs[2].error
    assert len(outs[0].outputs[0].token_ids) == 4 and len(outs[4].outputs[0].token_ids) == 4
    with pytest.raises(UsageError, match="outside the vocabulary"):
        engine.add_request([10**9])
    assert_no_leaks(engine)


def test_request_too_big_for_the_pool_is_refused_not_hung(make_engine):
    engine = make_engine(kv_cache_memory_bytes=2 << 20, block_size=16)  # ~45 tokens of KV
    (out,) = engine.generate(["word " * 60], SamplingParams(max_tokens=8))
    assert out.outputs[0].finish_reason == "refused" and "KV pool" in out.error
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    "config",
    [
        {"block_size": 0},
        {"block_size": 2.5},
        {"block_size": True},
        {"policy": "nope"},
        {"policy": None},
        {"preemption": "nope"},
        {"kv_cache_memory_bytes": 0},
        {"dtype": "float64"},
        {"max_num_seqs": 0},
        {"max_model_len": 1},
    ],
)
def test_bad_engine_config_is_a_usage_error_naming_the_field(config):
    # A UsageError (not any ValueError): the CLI prints it as the user's mistake, exit 2.
    with pytest.raises(UsageError) as info:
        EngineConfig(**config)
    (field,) = config
    assert info.value.param == field and field in str(info.value)


def test_unreadable_model_path_is_a_clear_error():
    from pagedkv.engine import LLMEngine

    with pytest.raises((FileNotFoundError, ValueError), match="nonexistent"):
        LLMEngine(EngineConfig(model="/nonexistent/model.gguf", log_startup=False))


def test_tiny_temperature_is_greedy_not_nan(make_engine):
    engine = make_engine()
    greedy, tiny = engine.generate(
        [PROMPT, PROMPT],
        [SamplingParams(max_tokens=5), SamplingParams(max_tokens=5, temperature=1e-30, seed=1)],
    )
    assert tiny.outputs[0].token_ids == greedy.outputs[0].token_ids
    with pytest.raises(ValueError):
        SamplingParams(temperature=float("nan"))


def test_streamed_text_is_never_taken_back_by_a_stop_string(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=12, stop=("7, 8",))
    streamed, final = "", None
    for delta, out in engine.stream("1, 2, 3, 4,", params):
        streamed += delta
        final = out
    text = final.outputs[0].text
    assert final.outputs[0].finish_reason == "stop" and "7" not in text
    assert streamed == text  # every delta was final: nothing printed had to be retracted


def test_cached_tokens_count_the_first_admission_only(make_engine):
    # A pool so small that sequences are preempted: their re-admission hits their own blocks,
    # which is not a prompt prefix hit.
    engine = make_engine(policy="paged:3", kv_cache_memory_bytes=60 * 46080, max_model_len=64)
    prompts = ["def fibonacci(n):", "The quick brown fox", "Once upon a time"]
    outs = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert engine.stats().preemptions > 0
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    # Children that cannot join the batch are recomputed: still no prefix hit for the request.
    engine = make_engine(block_size=4, max_num_seqs=1, max_model_len=128)
    params = SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=1)
    (out,) = engine.generate([PROMPT], params)
    assert out.num_cached_tokens == 0 and all(len(c.token_ids) == 4 for c in out.outputs)
    assert_no_leaks(engine)


def test_stats_include_the_last_and_first_step(make_engine):
    engine = make_engine()
    engine.generate([PROMPT], SamplingParams(max_tokens=1))  # finishes in its first step
    stats = engine.stats()
    assert stats.peak_used_blocks >= 1 and stats.kv_utilization_peak > 0
    assert stats.num_steps == 1 and stats.elapsed_s > 0 and stats.generated_tokens == 1


def test_generate_keeps_the_outputs_of_requests_added_elsewhere(make_engine):
    engine = make_engine()
    other = engine.add_request("The quick brown fox", SamplingParams(max_tokens=8))
    (mine,) = engine.generate([PROMPT], SamplingParams(max_tokens=2))
    assert len(mine.outputs[0].token_ids) == 2
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == [other] and len(finished[other].outputs[0].token_ids) == 8
    assert_no_leaks(engine)
