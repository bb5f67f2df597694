"""The Python API as a user calls it, including the ways it can be misused."""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams
from pagedkv.errors import UsageError

from .conftest import assert_no_leaks

SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


def test_aborting_a_stream_ends_it(make_engine):
    engine = make_engine()
    stream = engine.stream("Tell me a long story about", SamplingParams(max_tokens=200))
    seen = []
    for _, out in stream:  # would spin forever if the stream did not notice the abort
        seen.append(out)
        if len(seen) == 2:
            assert engine.abort(out.request_id)
    assert len(seen) == 2 and not seen[-1].finished
    assert_no_leaks(engine)


def test_a_bare_string_is_one_prompt(make_engine):
    engine = make_engine()
    outs = engine.generate("Hello", SHORT)
    assert len(outs) == 1 and outs[0].prompt == "Hello"
    ids = engine.tokenizer.encode("Hello")
    assert engine.generate(ids, SHORT)[0].prompt_token_ids == ids  # one list of ids: one prompt


def test_a_prompt_of_the_wrong_type_queues_nothing(make_engine):
    engine = make_engine()
    with pytest.raises(UsageError, match="string or a list of token ids"):
        engine.generate(["Hello", None], SHORT)
    assert not engine.has_unfinished()  # "Hello" was not left behind as an orphan
    assert_no_leaks(engine)


def test_explicit_ids_never_collide_with_automatic_ones(make_engine):
    engine = make_engine()
    mine = [engine.add_request("a", SHORT, request_id=f"req-{i}") for i in range(3)]
    auto = [engine.add_request("b", SHORT) for _ in range(3)]
    assert len(set(mine + auto)) == 6
    with pytest.raises(UsageError, match="already in use"):
        engine.add_request("c", SHORT, request_id="req-1")
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)


def test_every_entry_point_refuses_n_samples_the_pool_cannot_hold(make_engine):
    # 4 MiB at 46,080 bytes a token = 91 slots: 5 blocks of 16, 4 usable (block 0 is null).
    # One sample of 20 + 8 tokens needs 2 blocks; four need 1 shared + 4 own = 5.
    engine = make_engine(kv_cache_memory_bytes=4 << 20, block_size=16)
    assert engine.info.num_blocks == 4
    prompt = engine.tokenizer.encode("word " * 20)[:20]
    params = SamplingParams(max_tokens=8, n=4, temperature=1.0, seed=1)
    with pytest.raises(UsageError) as info:
        engine.check_request(prompt, params)
    assert info.value.param == "n" and info.value.code == "kv_pool_too_small"
    with pytest.raises(UsageError):
        engine.add_request(prompt, params)
    (out,) = engine.generate([prompt], params)  # generate() answers the same, per prompt
    assert out.error == str(info.value)
    (ok,) = engine.generate([prompt], SamplingParams(max_tokens=8, n=1))
    assert ok.error is None
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 1.0, "top_p": 1e-300}, "top_p"),
        ({"top_p": 1e-46}, "top_p"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_values_the_sampler_cannot_run_are_refused_naming_the_field(kwargs, param):
    with pytest.raises(UsageError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


def test_top_k_minus_one_is_off_as_in_vllm(make_engine):
    assert SamplingParams(top_k=-1).top_k == 0
    engine = make_engine()
    a = engine.generate("Once upon", SamplingParams(max_tokens=6, temperature=0.8, seed=3))
    b = engine.generate(
        "Once upon", SamplingParams(max_tokens=6, temperature=0.8, seed=3, top_k=-1)
    )
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_a_huge_top_k_samples_like_no_top_k(make_engine):
    engine = make_engine()
    base = SamplingParams(max_tokens=6, temperature=0.8, seed=5)
    big = SamplingParams(max_tokens=6, temperature=0.8, seed=5, top_k=2**31 - 1)
    a, b = engine.generate(["Once upon", "Once upon"], [base, big])
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_leaving_a_stream_early_frees_its_blocks_and_keeps_other_outputs(make_engine):
    engine = make_engine()
    other = engine.add_request("Count to ten:", SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in engine.stream("Tell me a long story about", SamplingParams(max_tokens=200)):
        break  # the consumer leaves after the first output
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs[other].finished and len(outs[other].outputs[0].token_ids) == 3
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    ("prompts", "params", "words"),
    [
        (None, None, "prompts must be"),
        (42, None, "prompts must be"),
        (b"hi", None, "a prompt is a string or a list of token ids"),
        ("x", 3, "params must be a SamplingParams"),
        ("x", "bad", "params must be a SamplingParams"),
        ("x", {}, "params must be a SamplingParams"),
        (["x", "y"], [SHORT], "1 sampling params for 2 prompts"),
    ],
)
def test_wrong_types_in_the_python_api_are_usage_errors(make_engine, prompts, params, words):
    engine = make_engine()
    with pytest.raises(UsageError, match=words):
        engine.generate(prompts, params)
    with pytest.raises(UsageError, match="params must be"):
        engine.add_request("x", params={})
    assert not engine.has_unfinished()
