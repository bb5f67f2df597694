"""``pagedkv serve`` at tensor-parallel size 2 (one worker process, gloo): chats, streaming,
``n`` > 1 (forked blocks copied on both ranks), prefix hits, and swap preemption (blocks to
and from each rank's host swap pool) all give the single-rank engine's greedy text; the
replica's info names its size and heads per rank."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model
from pagedkv.server import ServerConfig, create_app, start_in_background

from .conftest import LOOPBACK, MODEL_NAME, assert_idle, metrics

# 20 usable blocks of 16 tokens on every rank: 4 samples of up to 110 tokens sharing a
# 50-token prompt need 19, two such requests 38 (they swap).
BLOCKS = 21
CHAT = [{"role": "user", "content": "Tell me about pages."}]
LONG = "p" * 50


def _sizes(record_bytes: int) -> dict:
    return dict(
        kv_cache_memory_bytes=BLOCKS * 16 * record_bytes,
        preemption_mode="swap",
        swap_space_bytes=1 << 20,
        log_startup=False,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-serve-tp")
    make_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def reference(folder):
    """The single-rank engine's greedy texts: the chat, the long prompt (12 and 60 tokens)."""
    config = EngineConfig(**_sizes(512))
    engine = LLMEngine(config, parts=build_parts(config, load_model(folder, progress=False)))
    prompts = [engine.tokenizer.encode_chat(CHAT), engine.tokenizer.encode(LONG)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 60)]
    return [o.outputs[0].text for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def url(folder):
    engine = LLMEngine(EngineConfig(model=str(folder), tensor_parallel_size=2, **_sizes(256)))
    config = ServerConfig(served_model_name=MODEL_NAME, host=LOOPBACK, port=0, log_level="warning")
    with start_in_background(create_app(engine, config), config) as server:
        yield server.url
    assert engine.parts.ranks.workers.procs[0].exitcode == 0  # stopped with the server


def _post(url: str, path: str, body: dict) -> dict:
    resp = httpx.post(f"{url}/v1/{path}", json={"model": MODEL_NAME, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_info_names_the_ranks(url):
    info = httpx.get(f"{url}/pagedkv/info").json()
    assert info["tensor_parallel"] == {"size": 2, "heads_per_rank": 2, "kv_heads_per_rank": 1}
    assert info["page_format"]["tp_size"] == 2 and info["page_format"]["model_kv_heads"] == 2


def test_chat_and_its_stream(url, reference):
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    out = _post(url, "chat/completions", body)
    assert out["choices"][0]["message"]["content"] == reference[0]
    text = ""
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        timeout=120,
        json={"model": MODEL_NAME, **body, "stream": True},
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    assert text == reference[0]


def test_samples_prefix_hits_and_swaps(url, reference):
    body = {"prompt": LONG, "max_tokens": 60, "n": 4, "temperature": 0, "ignore_eos": True}
    first = _post(url, "completions", body)
    assert [c["text"] for c in first["choices"]] == [reference[1]] * 4
    # Two such requests at once do not fit the pool: some samples swap out and back in.
    with ThreadPoolExecutor(2) as threads:
        outs = list(threads.map(lambda _: _post(url, "completions", body), range(2)))
    for out in outs:
        assert [c["text"] for c in out["choices"]] == [reference[1]] * 4
    # The prompt's 3 full blocks were cached from the first request.
    assert min(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs) == 48
    assert_idle(url)
    m = metrics(url)
    assert m["pagedkv_swap_in_sequences_total"] == m["pagedkv_swap_out_sequences_total"] > 0
