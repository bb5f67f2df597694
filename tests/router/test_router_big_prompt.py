"""Issue 27's "one 7.9 MB prompt stalls every client" on ``route``: ``/health`` took 6.3 s
while the router's edge tokenized ``"hello world " * 690000``. The edge now refuses a text
that cannot fit by its length, before tokenizing (``server/prompt_limits.py``), tokenizes on a
worker thread without holding the GIL (tests/server/test_big_prompts.py), and ``/health``
answers while a big request is inside its refusal or its tokenizing (ordering: a gate holds
the request there until ``/health`` has answered)."""

from __future__ import annotations

import httpx
import pytest

from pagedkv.router.app import create_router_app
from pagedkv.router.config import RouterConfig
from pagedkv.router.server import load_tokenizer
from pagedkv.server import request_params
from pagedkv.server.prompt_limits import chars_per_token_bound, check_prompt_chars
from tests.router.fakes import FakeFleet, FakeReader, serving
from tests.server.test_big_prompts import BIG_PROMPT, GENEROUS_S, Gate, health_while_inside

MAX_MODEL_LEN = 2048  # the fake replicas' (tests/router/fakes.py)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture
def router(tokenizer):
    fleet = FakeFleet(1)
    config = RouterConfig((fleet.replicas[0].url,), policy="round-robin", health_interval_s=0.1)
    app = create_router_app(config, [fleet.replicas[0].info()], tokenizer,
                            reader_factory=FakeReader, transport=fleet.transport)  # fmt: skip
    with serving(app) as url:
        yield url, fleet


def test_health_answers_while_an_8mb_prompt_is_refused(router, monkeypatch):
    url, fleet = router
    gate = Gate(check_prompt_chars)
    monkeypatch.setattr(request_params, "check_prompt_chars", gate)
    big, health_s = health_while_inside(url, "/v1/completions", {"prompt": BIG_PROMPT}, gate)
    assert big.status_code == 400, big.text
    error = big.json()["error"]
    assert error["param"] == "prompt" and "refused before tokenizing" in error["message"]
    assert not fleet.replicas[0].bodies  # never forwarded
    print(f"router /health during the refusal: {health_s * 1000:.1f} ms")


def test_health_answers_while_a_prompt_is_tokenized(router, tokenizer, monkeypatch):
    url, fleet = router
    gate = Gate(tokenizer.encode)
    monkeypatch.setattr(tokenizer, "encode", gate)
    body = {"prompt": "hello world " * 1000, "max_tokens": 2}
    big, health_s = health_while_inside(url, "/v1/completions", body, gate)
    assert big.status_code == 200, big.text
    assert fleet.replicas[0].bodies == [body]
    print(f"router /health during the tokenizing: {health_s * 1000:.1f} ms")


def test_the_length_bound_never_refuses_a_prompt_that_fits(router, tokenizer):
    """SmolLM2's longest token is 81 characters ("\\n" and 80 spaces); a prompt of 2047 of them
    is 2047 tokens, inside a context of 2048 with ``max_tokens`` 1. A bound of 32 characters
    per token would have refused it by its length."""
    url, fleet = router
    vocab = tokenizer.backend.get_vocab()
    longest = tokenizer.decode([vocab[max(vocab, key=len)]], skip_special_tokens=False)
    assert chars_per_token_bound(tokenizer) >= len(longest) > 32
    fits = longest * (MAX_MODEL_LEN - 1)
    assert len(tokenizer.encode(fits, add_special_tokens=False)) == MAX_MODEL_LEN - 1
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": fits, "max_tokens": 1},
                      timeout=GENEROUS_S)  # fmt: skip
    assert resp.status_code == 200, resp.text
    over = httpx.post(f"{url}/v1/completions", timeout=GENEROUS_S,
                      json={"prompt": longest * (MAX_MODEL_LEN + 1), "max_tokens": 1})  # fmt: skip
    assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
    assert "refused before tokenizing" in over.json()["error"]["message"]
