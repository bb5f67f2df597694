"""The OpenAI routes on a tiny random model, driven by the official ``openai`` client.

The model's text is meaningless; what is checked is the protocol: shapes, usage, streaming
deltas adding up to the whole text, ``n``, logprobs, stop strings, prefix-cache isolation by
``cache_salt``, continuous batching, and that nothing stays allocated afterwards.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest

from .conftest import MODEL_NAME, assert_idle, metrics, running_server

BLOCK_SIZE_TOKENS = 4
NUM_BLOCKS = 64
POOL = dict(
    block_size=BLOCK_SIZE_TOKENS,
    kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_SIZE_TOKENS * 512,  # 512 bytes per token
    max_model_len=128,
)
PROMPT = "The quick brown fox jumps over the lazy dog"
# Text never stops early on the random model's end-of-sequence token.
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_loaded):
    with running_server(tiny_loaded, **POOL) as (url, app):
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_and_health(client, server):
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME and model.object == "model"
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_completion_usage_and_finish(client, server):
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0, user="alice",
        extra_body=NO_EOS,
    )  # fmt: skip
    (choice,) = out.choices
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert choice.finish_reason == "length" and choice.index == 0
    assert out.usage.prompt_tokens == len(PROMPT)  # the tiny tokenizer: one token per byte
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == len(PROMPT) + 7
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert_idle(server)


def test_chat_completion(client):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        extra_body=NO_EOS,
    )
    (choice,) = out.choices
    assert out.object == "chat.completion"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 5


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_adds_up_to_the_whole_text(client, chat):
    args = dict(model=MODEL_NAME, max_tokens=12, temperature=0, extra_body=NO_EOS)
    if chat:
        create, args["messages"] = (
            client.chat.completions.create,
            [{"role": "user", "content": PROMPT}],
        )
    else:
        create, args["prompt"] = client.completions.create, PROMPT
    whole = create(**args)
    chunks = list(create(**args, stream=True, stream_options={"include_usage": True}))
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    if chat:
        assert deltas[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in deltas)
        assert text == whole.choices[0].message.content
    else:
        text = "".join(c.choices[0].text for c in deltas)
        assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, chat):
    """vLLM's ``stream_options.continuous_usage_stats`` (what guidellm sends): each chunk's
    usage counts the tokens generated up to it; the final usage chunk stays."""
    args = dict(model=MODEL_NAME, max_tokens=8, temperature=0, extra_body=NO_EOS, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})  # fmt: skip
    if chat:
        chunks = list(client.chat.completions.create(
            **args, messages=[{"role": "user", "content": PROMPT}]))  # fmt: skip
    else:
        chunks = list(client.completions.create(**args, prompt=PROMPT))
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    counts = [c.usage.completion_tokens for c in deltas]
    assert counts == sorted(counts) and counts[-1] == 8 and counts[0] >= 1
    prompt_tokens = {c.usage.prompt_tokens for c in chunks}
    assert len(prompt_tokens) == 1 and all(
        c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks
    )
    # without include_usage it changes nothing (vLLM's rule): no usage anywhere
    plain = list(client.completions.create(
        **{**args, "stream_options": {"continuous_usage_stats": True}}, prompt=PROMPT))  # fmt: skip
    assert all(c.usage is None for c in plain)


def test_penalties_and_logit_bias_reach_the_sampler(client):
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                extra_body=NO_EOS)  # fmt: skip
    tokens = {}
    for t in (17, 18):
        out = client.completions.create(**args, logit_bias={str(t): 100})
        tokens[t] = out.choices[0].logprobs.tokens
    assert len(set(tokens[17])) == 1 and len(set(tokens[18])) == 1 and tokens[17] != tokens[18]
    # biased towards 17, then penalised once it is generated: the repetition penalty divides
    # its ~100 logit by 100 and the presence penalty takes 2 more, leaving about -1, below
    # the best of the other (random) logits: 17 first, never again
    out = client.completions.create(
        **{**args, "extra_body": {**NO_EOS, "repetition_penalty": 100.0}},
        logit_bias={"17": 100}, presence_penalty=2.0,
    )  # fmt: skip
    generated = out.choices[0].logprobs.tokens
    assert generated[0] == tokens[17][0] and tokens[17][0] not in generated[1:]


def test_stop_string_cuts_the_text_streamed_or_not(client):
    """(The case where the stream must hold text back is in test_embedded: the random model's
    bytes rarely form whole characters, so its detokenizer holds them back anyway.)"""
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0, extra_body=NO_EOS)
    free = client.completions.create(**args).choices[0].text
    stop = free[10:13]  # three characters the greedy text contains
    whole = client.completions.create(**args, stop=[stop]).choices[0]
    assert whole.finish_reason == "stop" and whole.text == free[: free.index(stop)]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**args, stop=[stop], stream=True)
    )
    assert streamed == whole.text


def test_n2_samples_are_the_seeded_single_requests(client, server):
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body=NO_EOS)
    out = client.completions.create(**args, n=2, seed=11)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens == len(PROMPT)
    # Sample i of n is seeded seed + i: the same as a lone request with that seed.
    singles = [client.completions.create(**args, seed=11 + i).choices[0].text for i in range(2)]
    assert [c.text for c in out.choices] == singles
    assert singles[0] != singles[1]
    streamed = ["", ""]
    for chunk in client.completions.create(**args, n=2, seed=11, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == singles
    assert_idle(server)


def test_subnormal_temperature_is_greedy_not_a_crash(client, server):
    """1e-45 overflows the engine's sampler (inf logits); the server samples it greedily."""
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, extra_body=NO_EOS)
    tiny = client.completions.create(**args, temperature=1e-45).choices[0].text
    assert tiny == client.completions.create(**args, temperature=0).choices[0].text
    assert httpx.get(f"{server}/health").status_code == 200


def test_batch_of_prompts(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "another prompt"], max_tokens=3, n=2, temperature=0
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == len(PROMPT) + len("another prompt")


def test_token_id_prompt(client):
    out = client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == 3


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, extra_body=NO_EOS
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and len(top) <= 2  # two ids may decode to one string
        assert math.isclose(max(top.values()), chosen, abs_tol=1e-5)  # greedy picks the top one
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_EOS,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_streamed_logprobs_cover_every_token_once(client):
    """Tokens that print nothing yet (part of a UTF-8 character) report their logprobs with
    the next chunk that has text: every token exactly once, in order."""
    args = dict(model=MODEL_NAME, max_tokens=20, temperature=0, extra_body=NO_EOS)
    whole = client.completions.create(**args, prompt=PROMPT, logprobs=1).choices[0].logprobs
    streamed = []
    for chunk in client.completions.create(**args, prompt=PROMPT, logprobs=1, stream=True):
        if chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == whole.token_logprobs and len(streamed) == 20
    chat = []
    for chunk in client.chat.completions.create(
        **args, messages=[{"role": "user", "content": PROMPT}], logprobs=True, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            chat += [t.logprob for t in chunk.choices[0].logprobs.content]
    assert len(chat) == 20


def test_streamed_text_offsets_equal_the_whole_response_under_a_stop_hold_back(client):
    """A stop string makes the stream hold text back; token offsets must not lag with it."""
    args = dict(model=MODEL_NAME, max_tokens=12, temperature=0, logprobs=1, stop=["zzzzzz"],
                extra_body=NO_EOS)  # fmt: skip
    whole = client.completions.create(**args, prompt=PROMPT).choices[0].logprobs.text_offset
    streamed = []
    for chunk in client.completions.create(**args, prompt=PROMPT, stream=True):
        if chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.text_offset
    assert streamed == whole and whole == sorted(whole)


def test_cache_salt_isolates_tenants(client):
    """Same prompt: the same tenant hits its own prefix, another tenant (or no salt) does not."""
    prompt = "tenant-isolation " * 3  # 51 tokens: 12 full blocks of 4

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        out = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
        )
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    hit = cached("tenant-a")
    assert hit > 0 and hit % BLOCK_SIZE_TOKENS == 0 and hit <= len(prompt)
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-b") == hit


def test_concurrent_streams_share_the_running_batch(server):
    """Requests arriving together decode in one batch (continuous batching), and all finish."""
    num_clients = 8

    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        text = ""
        stream = await c.completions.create(
            model=MODEL_NAME, prompt=f"{i} {PROMPT}", max_tokens=40, temperature=0,
            stream=True, extra_body=NO_EOS,
        )  # fmt: skip
        async for chunk in stream:
            text += chunk.choices[0].text
        return text

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(num_clients)))

    before = metrics(server)["pagedkv_requests_total{outcome=finished}"]
    texts = asyncio.run(main())
    assert len(texts) == num_clients and all(texts)
    m = metrics(server)
    assert m["pagedkv_requests_total{outcome=finished}"] - before == num_clients
    assert m["pagedkv_sequences_running_peak"] >= 2
    assert_idle(server)


def test_metrics_exposition(client, server):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    m = metrics(server)
    info = [k for k in m if k.startswith("pagedkv_page_format_info{")]
    assert len(info) == 1 and f"block_size={BLOCK_SIZE_TOKENS}," in info[0]
    assert "policy=vllm" in info[0] and "kv_dtype=fp32" in info[0]
    engine = [k for k in m if k.startswith("pagedkv_engine_info{")]
    assert engine == ["pagedkv_engine_info{attention_backend=native,device=cpu,dtype=float32}"]
    assert (
        m["pagedkv_kv_blocks_total"]
        == m["pagedkv_kv_blocks_free"] + m["pagedkv_kv_blocks_used"] + m["pagedkv_kv_blocks_cached"]
    )
    assert m["pagedkv_generated_tokens_total"] >= 2
    assert m["pagedkv_time_to_first_token_seconds_count"] >= 1
    assert m["pagedkv_prefix_query_tokens_total"] >= len(PROMPT)
    for name in ("pagedkv_kv_utilization_ratio", "pagedkv_preemptions_total",
                 "pagedkv_prefix_hit_tokens_total", "pagedkv_sequences_waiting"):  # fmt: skip
        assert name in m
