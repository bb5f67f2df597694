"""Structured output under a hostile client (issue 53), over HTTP on a tiny random model.

Every body is parsed with a strict JSON parser (no ``NaN`` or ``Infinity``: a ``-Infinity``
logprob used to go out in streams and make whole responses a 500); log-probabilities beside any
output constraint are finite and the model's own (the same values an unconstrained request
reports for the same prompt); grammars that cannot run are 400s naming the field, before the
request runs, with no parser internals in the message, and a repeat gets the same 400 (a failed
compile is never cached as a usable matcher).
"""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import MODEL_NAME, running_server

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
          "required": ["name"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_2k_loaded):
    with running_server(tiny_2k_loaded, max_model_len=2048) as (url, _):
        yield url


def _no_constants(name: str):
    raise ValueError(f"not JSON: {name}")


def strict(text: str):
    """``json.loads`` refusing NaN and infinities, as JSON itself does."""
    return json.loads(text, parse_constant=_no_constants)


def post(server: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}/v1/{route}", json={"model": MODEL_NAME, **body}, timeout=60)


def stream_events(server: str, route: str, body: dict) -> list[dict]:
    r = post(server, route, {**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [x[len("data: ") :] for x in r.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [strict(x) for x in lines[:-1]]


CONSTRAINED = {
    "json_schema": ("chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 5,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": PERSON}}}),
    "choice": ("completions", {"prompt": "x", "logprobs": 5, "guided_choice": ["yes", "no"]}),
    "regex": ("completions", {"prompt": "x", "logprobs": 3, "guided_regex": "[0-9]{2,6}"}),
    "forced_call": ("chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 3,
                    "tools": [WEATHER], "tool_choice": "required"}),
    "echo": ("completions", {"prompt": "x y", "echo": True, "logprobs": 2, "prompt_logprobs": 2,
             "guided_choice": ["yes", "no"]}),
}  # fmt: skip


def _logprobs(route: str, choice: dict) -> list[float]:
    """Every logprob of a choice (chosen and alternatives), in order."""
    lp = choice.get("logprobs") or {}
    if route == "completions":
        tops = [v for top in lp.get("top_logprobs") or [] if top for v in top.values()]
        return [v for v in lp.get("token_logprobs") or [] if v is not None] + tops
    out = []
    for entry in lp.get("content") or []:
        out += [entry["logprob"], *(t["logprob"] for t in entry["top_logprobs"])]
    return out


@pytest.mark.parametrize("case", list(CONSTRAINED))
def test_logprobs_beside_a_constraint_are_finite_json(server, case):
    route, body = CONSTRAINED[case]
    body = {**body, "max_tokens": 24, "temperature": 1.0, "seed": 5}
    r = post(server, route, body)
    assert r.status_code == 200, r.text
    (choice,) = strict(r.text)["choices"]
    values = _logprobs(route, choice)
    assert values and all(-1e4 < v <= 0 for v in values), values
    # The alternatives are the model's own top-k: as many as asked, never cut by the mask.
    width = body.get("top_logprobs") or body.get("logprobs")
    if route == "completions":
        assert all(len(t) >= min(width, 2) for t in choice["logprobs"]["top_logprobs"] if t)
    else:
        assert all(len(e["top_logprobs"]) == width for e in choice["logprobs"]["content"])
    events = stream_events(server, route, body)
    streamed = [v for e in events for c in e.get("choices", []) for v in _logprobs(route, c)]
    assert streamed and all(-1e4 < v <= 0 for v in streamed)


def test_a_constraint_does_not_change_the_reported_logprobs(server):
    """The first token's top-5 under a choice constraint equal those of the same prompt
    without one: the mask picks the token, the reported distribution stays the model's."""
    body = {"prompt": "x", "logprobs": 5, "max_tokens": 1, "temperature": 0}
    free = strict(post(server, "completions", body).text)["choices"][0]["logprobs"]
    held = strict(post(server, "completions", {**body, "guided_choice": ["yes", "no"]}).text)
    top_free, top_held = free["top_logprobs"][0], held["choices"][0]["logprobs"]["top_logprobs"][0]
    assert top_held.keys() == top_free.keys()
    assert all(abs(top_held[k] - top_free[k]) < 1e-5 for k in top_free)


UNRUNNABLE = [
    ({"guided_regex": "a{1000000}"}, "guided_regex"),
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^a{1000000}$"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
      "schema": {"$ref": "#"}}}}, "response_format.json_schema.schema"),
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
      "$ref": "#/$defs/a"}}, "guided_json"),
    ({"structured_outputs": {"grammar": "start: start"}}, "structured_outputs.grammar"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "loop",
      "parameters": {"$ref": "#"}}}], "tool_choice": "required"}, "tools.1.function.parameters"),
]  # fmt: skip


@pytest.mark.parametrize("body, param", UNRUNNABLE, ids=[p for _, p in UNRUNNABLE])
def test_a_grammar_that_cannot_run_is_a_400_naming_its_field(server, body, param):
    for _ in range(2):  # the same answer again: nothing was cached half-built
        r = post(server, "chat/completions", {"messages": ASK, "max_tokens": 8, **body})
        assert r.status_code == 400, r.text
        error = strict(r.text)["error"]
        assert error["param"] == param, error
        assert "<state>" not in error["message"] and "Parser" not in error["message"], error
        assert len(error["message"]) < 400
    ok = post(server, "chat/completions", {"messages": ASK, "max_tokens": 4})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "body, param, words",
    [({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "top_logprobs must be an integer"),
     ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
         {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
      "messages.1.tool_calls.1.function.arguments", "a tool call's arguments must be JSON")],
)  # fmt: skip
def test_errors_name_the_field_as_the_client_spelled_it(server, body, param, words):
    r = post(server, "chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = strict(r.text)["error"]
    assert error["param"] == param and error["message"].startswith(words), error
