"""Issue 27's "one 7.9 MB prompt stalls every client" on ``serve``: ``/health`` took 6.7 s
while ``"hello world " * 690000`` was tokenized. Three causes, three tests:

* the tokenizer held the GIL while it worked (``tokenizers``' ``encode``), so the worker
  thread it ran on stopped the event loop: a thread runs while another tokenizes;
* a text far over the context was tokenized before being refused: now it is refused by its
  length (``server/prompt_limits.py``), a 400 naming ``prompt`` / ``messages``;
* ``/health`` answers while a big request is inside its refusal or its tokenizing. Ordering,
  not milliseconds: a gate holds the big request there until ``/health`` has answered.
"""

from __future__ import annotations

import sys
import threading
import time

import httpx
import pytest

from pagedkv.router.server import load_tokenizer
from pagedkv.server import request_params
from pagedkv.server.errors import APIError
from pagedkv.server.prompt_limits import check_prompt_chars, max_prompt_chars

from .conftest import running_server

BIG_PROMPT = "hello world " * 690_000  # the 7.9 MB prompt
GENEROUS_S = 60.0


class Gate:
    """Wraps ``real``: a call says it ``entered``, then waits for ``release`` before going on."""

    def __init__(self, real) -> None:
        self.real, self.entered, self.release = real, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        assert self.release.wait(GENEROUS_S), "the test never released the gate"
        return self.real(*args, **kwargs)


def health_while_inside(
    url: str, path: str, body: dict, gate: Gate
) -> tuple[httpx.Response, float]:
    """POST ``body`` and, once it is inside ``gate``, GET ``/health``: it must answer while the
    big request is still held. Returns the big request's answer and ``/health``'s seconds
    (a measurement for the record, not asserted)."""
    answer: dict[str, httpx.Response] = {}

    def post() -> None:
        answer["big"] = httpx.post(f"{url}{path}", json=body, timeout=GENEROUS_S)

    big = threading.Thread(target=post)
    big.start()
    try:
        assert gate.entered.wait(GENEROUS_S), "the big request never reached the gate"
        started_s = time.perf_counter()
        health = httpx.get(f"{url}/health", timeout=GENEROUS_S)
        health_s = time.perf_counter() - started_s
        assert health.status_code == 200
        assert big.is_alive(), "the big request finished before /health was asked"
    finally:
        gate.release.set()
        big.join(GENEROUS_S)
    return answer["big"], health_s


def test_tokenizing_a_long_text_lets_other_threads_run():
    tokenizer = load_tokenizer(None)
    text = "hello world " * 200_000  # 2.4 MB: about a second of tokenizing
    entered, done = threading.Event(), []

    def encode() -> None:
        entered.set()
        tokenizer.encode(text)
        done.append(True)

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no forced switch: a thread holding the GIL keeps it
    try:
        worker = threading.Thread(target=encode)
        worker.start()
        entered.wait()
        # This line runs only once the worker lets go of the GIL: inside the encoding if the
        # tokenizer releases it, after the worker ended if it does not.
        ran_while_encoding = not done
        worker.join()
    finally:
        sys.setswitchinterval(old)
    assert ran_while_encoding


def test_a_prompt_over_the_context_by_its_length_is_refused_before_tokenizing(
    tiny_loaded, monkeypatch
):
    with running_server(tiny_loaded) as (url, app):
        tokenizer = app.state.tokenizer

        def no_tokenizing(*args, **kwargs):
            raise AssertionError("a prompt refused by its length was tokenized")

        monkeypatch.setattr(tokenizer, "encode", no_tokenizing)
        monkeypatch.setattr(tokenizer, "encode_chat", no_tokenizing)
        for path, body, param, what in (
            ("/v1/completions", {"prompt": BIG_PROMPT}, "prompt", "the prompt has"),
            ("/v1/completions", {"prompt": ["hi", BIG_PROMPT]}, "prompt", "prompt 1 has"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG_PROMPT}]},
             "messages", "the messages' contents hold"),
        ):  # fmt: skip
            resp = httpx.post(f"{url}{path}", json=body, timeout=GENEROUS_S)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == param and error["code"] == "context_length_exceeded"
            assert error["message"].startswith(f"{what} {len(BIG_PROMPT)} characters")
            assert "refused before tokenizing" in error["message"]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_the_length_bound_refuses_only_past_the_limit(tiny_loaded):
    from pagedkv.server import protocol as p

    tokenizer = tiny_loaded[-1]
    limit = max_prompt_chars(tokenizer, 128)
    check_prompt_chars(p.CompletionRequest(prompt="y" * limit), tokenizer, 128)
    with pytest.raises(APIError, match=f"has {limit + 1} characters"):
        check_prompt_chars(p.CompletionRequest(prompt="y" * (limit + 1)), tokenizer, 128)


def test_health_answers_while_an_8mb_prompt_is_refused(tiny_loaded, monkeypatch):
    gate = Gate(check_prompt_chars)
    monkeypatch.setattr(request_params, "check_prompt_chars", gate)
    with running_server(tiny_loaded) as (url, _):
        big, health_s = health_while_inside(url, "/v1/completions", {"prompt": BIG_PROMPT}, gate)
    assert big.status_code == 400 and big.json()["error"]["param"] == "prompt"
    print(f"/health during the refusal: {health_s * 1000:.1f} ms")


def test_health_answers_while_a_prompt_is_tokenized(tiny_loaded, monkeypatch):
    with running_server(tiny_loaded) as (url, app):
        gate = Gate(app.state.tokenizer.encode)
        monkeypatch.setattr(app.state.tokenizer, "encode", gate)
        body = {"prompt": "hello " * 8, "max_tokens": 2}
        big, health_s = health_while_inside(url, "/v1/completions", body, gate)
    assert big.status_code == 200, big.text
    print(f"/health during the tokenizing: {health_s * 1000:.1f} ms")
