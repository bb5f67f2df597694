"""The rule for fields beyond the implemented ones (server/unknown_fields.py): a field OpenAI or
vLLM define is accepted at its neutral value and a 400 naming it otherwise; a field nobody
defines is ignored, logged once, and listed in the ``x-pagedkv-ignored-fields`` header; nested
objects still refuse unknown keys; a wrong type of a known field is still a 400."""

from __future__ import annotations

import logging

import httpx
import pytest

from .conftest import MODEL_NAME, running_server

HEADER = "x-pagedkv-ignored-fields"


@pytest.fixture(scope="module")
def url(tiny_loaded):
    with running_server(tiny_loaded, max_model_len=128) as (base, _):
        yield base


def post(url, route="completions", **body):
    body.setdefault("model", MODEL_NAME)
    if route == "completions":
        body.setdefault("prompt", "hi")
    else:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    body.setdefault("max_tokens", 2)
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=30)


def test_unknown_fields_are_ignored_logged_once_and_named_in_a_header(url, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        first = post(url, my_client_trace="abc", temprature=0.5)
        again = post(url, route="chat/completions", my_client_trace="x", stream=True)
    assert first.status_code == 200 and again.status_code == 200
    assert first.headers[HEADER] == "my_client_trace, temprature"  # a typo shows here
    assert again.headers[HEADER] == "my_client_trace"
    warned = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert sum("my_client_trace" in w for w in warned) <= 1
    assert HEADER not in post(url).headers


@pytest.mark.parametrize(
    "field, neutral, other",
    [("use_beam_search", False, True), ("skip_special_tokens", True, False),
     ("priority", 0, 5), ("modalities", ["text"], ["text", "audio"]),
     ("include_stop_str_in_output", False, True), ("allowed_token_ids", None, [1, 2])],
)  # fmt: skip
def test_fields_defined_elsewhere_work_at_their_neutral_value_only(url, field, neutral, other):
    ok = post(url, **{field: neutral})
    assert ok.status_code == 200 and HEADER not in ok.headers
    bad = post(url, **{field: other})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == field and bad.json()["error"]["code"] == "unsupported"


def test_completion_only_fields_are_refused_on_chat(url):
    for field, value in (("echo", True), ("prompt_logprobs", 1)):
        r = post(url, route="chat/completions", **{field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_informational_fields_pass_with_any_value(url):
    r = post(url, route="chat/completions", metadata={"a": "b"}, store=True, service_tier="auto")
    assert r.status_code == 200 and HEADER not in r.headers


def test_known_fields_and_nested_objects_stay_strict(url):
    assert post(url, max_tokens="5").json()["error"]["param"] == "max_tokens"
    r = post(url, stream=True, stream_options={"include_usage": True, "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.bogus"
