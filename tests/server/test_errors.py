"""Every malformed request gets an OpenAI-style JSON error with the right status, and the
server keeps serving; ``--api-key`` guards every ``/v1`` route; an engine failure is a 500."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import MODEL_NAME, assert_idle, metrics, running_server
from .test_api import POOL

GOOD = {"prompt": "hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (route, raw body, status, error code, param)
BAD_REQUESTS = [
    ("completions", b"{not json", 400, "invalid_json", None),
    ("completions", b"", 400, "invalid_json", None),
    ("completions", b"[1, 2]", 400, "invalid_json", None),
    ("completions", {"prompt": "x", "max_tokens": "5"}, 400, "invalid_value", "max_tokens"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "invalid_value", "temperature"),
    ("completions", {"prompt": 5}, 400, "invalid_value", "prompt"),
    ("completions", {"max_tokens": 2}, 400, "invalid_value", "prompt"),
    ("completions", {"prompt": "x", "use_beam_search": True}, 400, "unsupported",
     "use_beam_search"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": -3}, 400, "invalid_value", "max_tokens"),
    ("completions", {"prompt": "y" * 120, "max_tokens": 20}, 400, "context_length_exceeded",
     "max_tokens"),
    ("completions", {"prompt": "y" * 200, "max_tokens": 1}, 400, "context_length_exceeded",
     "prompt"),
    # 10 + 100 tokens fit the context; 4 samples of them need 106 blocks of a 64-block pool.
    ("completions", {"prompt": "0123456789", "max_tokens": 100, "n": 4}, 400,
     "kv_pool_too_small", "n"),
    ("completions", {"prompt": "x", "n": 0}, 400, "invalid_value", "n"),
    # Every sampling field the engine refuses is named in ``param`` (issue 9, item 10).
    ("completions", {"prompt": "x", "temperature": -1}, 400, "invalid_value", "temperature"),
    ("completions", b'{"prompt": "x", "temperature": NaN}', 400, "invalid_value", "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "invalid_value", "top_p"),
    # Values the fp32 sampler cannot run (issue 9, items 1-2): refused, never a dead engine.
    ("completions", {"prompt": "x", "top_p": 1e-300, "temperature": 1}, 400, "invalid_value",
     "top_p"),
    ("completions", {"prompt": "x", "top_p": 1e-46, "temperature": 1}, 400, "invalid_value",
     "top_p"),
    ("completions", {"prompt": "x", "top_k": 9223372036854775808}, 400, "invalid_value",
     "top_k"),
    ("completions", {"prompt": "x", "top_k": -2}, 400, "invalid_value", "top_k"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, "invalid_value", "stop"),
    ("completions", {"prompt": "x", "temperature": 1e9}, 400, "invalid_value", "temperature"),
    ("completions", {"prompt": "x", "stop_token_ids": [5, 99999]}, 400, "invalid_value",
     "stop_token_ids"),
    ("completions", {"prompt": ["x", "y"], "n": 3}, 400, "too_many_samples", "prompt"),
    ("completions", {"prompt": "x", "n": 5}, 400, "too_many_samples", "n"),
    ("completions", {"prompt": "x", "logprobs": 99}, 400, "invalid_value", "logprobs"),
    ("completions", {"prompt": [5, 99999]}, 400, "invalid_value", "prompt"),
    ("completions", {"prompt": []}, 400, "invalid_value", "prompt"),
    # The sampling extensions: each bad value is a 400 naming its field.
    ("completions", {"prompt": "x", "presence_penalty": 3}, 400, "invalid_value",
     "presence_penalty"),
    ("completions", {"prompt": "x", "frequency_penalty": -2.5}, 400, "invalid_value",
     "frequency_penalty"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, 400, "invalid_value",
     "repetition_penalty"),
    ("completions", {"prompt": "x", "min_p": 1.5}, 400, "invalid_value", "min_p"),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "invalid_value",
     "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "invalid_value",
     "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 1000}}, 400, "invalid_value",
     "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"5": "x"}}, 400, "invalid_value",
     "logit_bias.5"),
    ("completions", {"prompt": "x", "min_tokens": 10, "max_tokens": 5}, 400, "invalid_value",
     "min_tokens"),
    ("completions", {"prompt": "x", "min_tokens": -1}, 400, "invalid_value", "min_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("completions", {"prompt": "x", "suffix": "y"}, 400, "unsupported", "suffix"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model_not_found", "model"),
    ("chat/completions", {"messages": []}, 400, "invalid_value", "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "invalid_value", "messages.0.role"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "invalid_value", "top_logprobs"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 99}, 400, "invalid_value",
     "top_logprobs"),
    ("chat/completions", {**CHAT, "max_tokens": None, "max_completion_tokens": 0}, 400,
     "invalid_value", "max_completion_tokens"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 2}, 400, "invalid_value",
     "max_completion_tokens"),
    ("chat/completions", {**CHAT, "model": "nope"}, 404, "model_not_found", "model"),
    ("chat/completions", {**CHAT, "stream": True, "max_tokens": 0}, 400, "invalid_value",
     "max_tokens"),
]  # fmt: skip


# A small cap, so that the cap's 400 is cheap to reach.
MAX_SAMPLES = 4


@pytest.fixture(scope="module")
def server(tiny_loaded):
    with running_server(tiny_loaded, max_samples_per_request=MAX_SAMPLES, **POOL) as (url, app):
        yield url


@pytest.mark.parametrize(("route", "body", "status", "code", "param"), BAD_REQUESTS)
def test_bad_request_gets_an_openai_error_and_the_server_goes_on(
    server, route, body, status, code, param
):
    with httpx.Client(base_url=f"{server}/v1", timeout=30) as http:
        if isinstance(body, bytes):
            r = http.post(route, content=body, headers={"Content-Type": "application/json"})
        else:
            r = http.post(route, json=body)
        assert r.status_code == status, r.text
        assert r.headers["content-type"].startswith("application/json")
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and error["code"] == code and error["param"] == param
        assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
        good = http.post(route, json=GOOD if route == "completions" else CHAT)
        assert good.status_code == 200, good.text
    assert_idle(server)


def test_top_k_minus_one_is_off_as_in_vllm(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    greedy = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    off = httpx.post(f"{server}/v1/completions", json={**body, "top_k": -1}, timeout=30)
    assert off.status_code == 200, off.text
    assert off.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_oversized_body_is_refused(server):
    from pagedkv.server.http_edge import MAX_BODY_BYTES

    body = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    r = httpx.post(f"{server}/v1/completions", content=body, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert httpx.post(f"{server}/v1/completions", json=GOOD, timeout=30).status_code == 200


def test_client_raises_the_matching_exceptions(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
        with pytest.raises(openai.BadRequestError, match="KV blocks"):
            client.completions.create(model=MODEL_NAME, prompt="0123456789", max_tokens=100,
                                      n=MAX_SAMPLES, stream=True)  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="other", messages=[{"role": "user", "content": "x"}]
            )
    assert httpx.get(f"{server}/v1/no-such-route").status_code == 404
    assert metrics(server)["pagedkv_requests_total{outcome=rejected}"] >= 3


def test_api_key_guards_every_v1_route(tiny_loaded):
    with running_server(tiny_loaded, api_key="s3cret", **POOL) as (url, _):
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("GET", "/v1/anything"),
                             ("GET", "/openapi.json"), ("GET", "/docs")]:  # fmt: skip
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Basic s3cret"}):  # fmt: skip
                r = httpx.request(method, url + path, json=GOOD, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        # The scheme is case-insensitive (RFC 7235, section 2.1); the key is not.
        for scheme in ("bearer", "BEARER", "Bearer", "bEaReR"):
            r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"{scheme} s3cret"})
            assert r.status_code == 200, scheme
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer S3CRET"})
        assert r.status_code == 401
        schema = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer s3cret"})
        assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
        assert httpx.head(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        with (
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as bad,
            pytest.raises(openai.AuthenticationError),
        ):
            bad.models.list()
        with openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0) as good:
            assert good.completions.create(model=MODEL_NAME, **GOOD).usage.completion_tokens >= 1


def test_one_failed_step_fails_its_requests_and_the_server_goes_on(tiny_loaded):
    """A step that raises (not traced to a request by the engine) fails the requests inside
    the engine with a 500; the next request is served, /health stays 200."""
    with running_server(tiny_loaded, **POOL) as (url, app):
        engine = app.state.engine_loop.engine
        real_step, calls = engine.step, []

        def step_failing_once():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("simulated kernel failure")
            return real_step()

        engine.step = step_failing_once
        r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "engine_error"
        assert "simulated kernel failure" in error["message"]
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30).status_code == 200
        assert_idle(url)
        assert metrics(url)["pagedkv_requests_total{outcome=failed}"] == 1


def test_an_engine_that_keeps_failing_is_marked_failed(tiny_loaded):
    """Only steps failing again and again mark the engine failed: then 503 and /health 503."""
    from pagedkv.server.engine_loop import MAX_STEP_FAILURES

    with running_server(tiny_loaded, **POOL) as (url, app):
        engine = app.state.engine_loop.engine

        def broken_step():
            raise RuntimeError("simulated kernel failure")

        engine.step = broken_step
        for _ in range(MAX_STEP_FAILURES - 1):
            r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
            assert httpx.get(f"{url}/health").status_code == 200
        r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "simulated" in health.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30).status_code == 503
