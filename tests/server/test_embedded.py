"""The embedded SmolLM2 behind the server: real text that matches the engine's own output, and
clients that leave mid-request get their request aborted and its blocks freed."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts

from .conftest import MODEL_NAME, assert_idle, metrics, running_server, wait_for

ENGINE = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20)
LONG_TOKENS = 300  # seconds of decoding on a shared CPU: a client leaves long before the end


@pytest.fixture(scope="module")
def server(embedded):
    with running_server(embedded, **ENGINE) as (url, app):
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_real_completion_matches_the_engine(client, embedded):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
    text = out.choices[0].text
    assert "Paris" in text
    config = EngineConfig(log_startup=False, **ENGINE)
    engine = LLMEngine(config, parts=build_parts(config, embedded))
    (ref,) = engine.generate([prompt], SamplingParams(max_tokens=6))
    assert text == ref.outputs[0].text


def test_chat_uses_the_model_template(client):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in out.choices[0].message.content
    # The rendered template (system default + im_start/im_end markers) is far longer than
    # the question: the prompt went through the chat template.
    assert out.usage.prompt_tokens > 20


def test_stream_with_a_multi_token_stop_string_never_takes_text_back(client):
    """The engine matches "7, 8" only once its last token arrives, after "7, " was reported;
    the stream must hold those characters back, then drop them with the match."""
    args = dict(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=["7, 8"])
    whole = client.completions.create(**args).choices[0]
    assert whole.finish_reason == "stop" and whole.text.rstrip().endswith("6,"), whole.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
    assert streamed == whole.text


def _aborted(url: str) -> float:
    return metrics(url)["pagedkv_requests_total{outcome=aborted}"]


def test_disconnect_mid_stream_aborts_and_frees_blocks(client, server):
    before = metrics(server)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=LONG_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for received, _ in enumerate(stream, start=1):
        if received == 3:
            break
    assert metrics(server)["pagedkv_kv_blocks_used"] > 0  # it is still decoding
    stream.close()  # the client goes away mid-stream
    wait_for(lambda: _aborted(server) == before["pagedkv_requests_total{outcome=aborted}"] + 1,
             20, "the request to be counted as aborted")  # fmt: skip
    assert_idle(server)
    after = metrics(server)
    generated = after["pagedkv_generated_tokens_total"] - before["pagedkv_generated_tokens_total"]
    assert generated < LONG_TOKENS  # stopped early, not run to the end
    # The server goes on serving.
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices


def test_client_timeout_on_a_plain_request_aborts_it(server):
    before = _aborted(server)
    body = {"prompt": "Once upon a time", "max_tokens": LONG_TOKENS, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.0)
    wait_for(lambda: _aborted(server) == before + 1, 20, "the request to be counted as aborted")
    assert_idle(server)


def test_stopping_the_server_ends_open_streams_with_an_error(embedded):
    with running_server(embedded, graceful_shutdown_s=1.0, **ENGINE) as (url, app):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=MODEL_NAME, prompt="Once upon a time", max_tokens=LONG_TOKENS, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        t0 = time.monotonic()
        app.state.server.stop()
        assert time.monotonic() - t0 < 10
        # An explicit error event, not a cut connection (APIConnectionError).
        with pytest.raises(openai.APIError, match="shutting down"):
            list(chunks)
        loop = app.state.engine_loop
        assert not loop.alive
        loop.engine.allocator.check_invariants()
        assert loop.engine.allocator.stats().num_used_blocks == 0
