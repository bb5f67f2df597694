"""Tools and structured output over HTTP, through the official ``openai`` client, on a tiny
random model (its free text is noise, so everything that parses here parses because of the
grammar): forced calls name offered functions with arguments that validate, ``auto`` parses the
Hermes format, tool results render in a later turn, streams carry the calls, JSON answers
validate, and every bad combination is a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from pagedkv.server.forced_calls import call_head
from pagedkv.server.tool_parse import ParsedCalls, streamable
from pagedkv.server.tools import ToolUse

from .conftest import MODEL_NAME, running_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Clock",
     "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                    "required": ["zone"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
          "required": ["name"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_2k_loaded):
    with running_server(tiny_2k_loaded, max_model_len=2048) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none")


def chat(client, **kw):
    kw.setdefault("temperature", 1.0)
    kw.setdefault("seed", 3)
    kw.setdefault("max_tokens", 100)
    return client.chat.completions.create(model=MODEL_NAME, **kw)


def check_calls(message, names=None) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


def test_required_and_named_choices_force_valid_calls(client):
    r = chat(client, messages=ASK, tools=TOOLS, tool_choice="required", n=3, max_tokens=110)
    for choice in r.choices:  # a random model may keep calling until its length limit
        assert choice.message.content is None, choice  # a forced call's text is never content
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.message.tool_calls or choice.finish_reason == "tool_calls":
            check_calls(choice.message)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, messages=ASK, tools=TOOLS, tool_choice=named)
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(check_calls(r.choices[0].message, ["get_time"])) == 1
    r = chat(client, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(check_calls(r.choices[0].message)) == 1


def test_auto_parses_hermes_calls_and_keeps_plain_text(client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    forced = {"structured_outputs": {"regex": re.escape(call)}}
    r = chat(client, messages=ASK, tools=TOOLS, extra_body=forced)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}
    plain = chat(client, messages=ASK, tools=TOOLS, extra_body={"guided_choice": ["sunny"]})
    assert plain.choices[0].message.content == "sunny" and not plain.choices[0].message.tool_calls
    none = chat(client, messages=ASK, tools=TOOLS, tool_choice="none",
                extra_body={"structured_outputs": {"regex": re.escape(call)}})  # fmt: skip
    assert none.choices[0].message.content == call  # "none": the text is not parsed


def test_a_tool_result_renders_in_the_next_turn(server, client):
    r = chat(client, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    assert chat(client, messages=turns, tools=TOOLS, max_tokens=5).choices[0].message.content
    ids = httpx.post(f"{server}/tokenize", json={"messages": turns, "tools": TOOLS}).json()
    text = httpx.post(f"{server}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert call.function.arguments in text and '"name": "get_weather"' in text
    assert "<tools>" in text  # the tool list, in the system turn this template lacks


def test_streamed_calls_arrive_in_the_last_chunk(client):
    chunks = list(chat(client, messages=ASK, tools=TOOLS, stream=True, parallel_tool_calls=False,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}))  # fmt: skip
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_json_answers_validate(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = chat(client, messages=ASK, response_format=fmt, n=4)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)
    stream = chat(client, messages=ASK, response_format=fmt, stream=True)
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in stream)),
                        PERSON)  # fmt: skip
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 100,
                   "structured_outputs": {"choice": ["yes", "no"]}, "temperature": 1}).json()  # fmt: skip
    assert r["choices"][0]["text"] in ("yes", "no")
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 100,
                   "guided_json": PERSON, "temperature": 1}).json()  # fmt: skip
    jsonschema.validate(json.loads(r["choices"][0]["text"]), PERSON)


@pytest.mark.parametrize(
    "body, param",
    [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
      "tool_choice.function.name"),
     ({"tool_choice": "required"}, "tool_choice"),
     ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
     ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
     ({"response_format": {"type": "xml"}}, "response_format.type"),
     ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
     ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
      "tools.0.function.name"),
     ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
      "response_format.json_schema"),
     ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
      "response_format.json_schema.schema"),
     ({"guided_regex": "(open"}, "guided_regex"),
     ({"guided_choice": []}, "guided_choice"),
     ({"guided_json": "{bad"}, "guided_json"),
     ({"guided_json": PERSON, "guided_regex": "a"}, "guided_regex"),
     ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar"),
     ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages.0.tool_call_id")],
)  # fmt: skip
def test_bad_tool_and_format_requests_are_400s(server, body, param):
    body = {"model": MODEL_NAME, "messages": ASK, **body}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{server}/health").status_code == 200


def test_parse_and_stream_rules():
    use = ToolUse(TOOLS, parse=True)
    text = 'Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> done'
    parsed = use.parse_text(text)
    assert [(n, json.loads(a)) for _, n, a in parsed.calls] == [("get_time", {"zone": "UTC"})]
    assert parsed.content == "Sure.  done"
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert use.parse_text(unknown).calls == [] and use.parse_text(unknown).content == unknown
    assert streamable("Hello <tool_c") == "Hello "
    assert streamable("Hello <tool_call>{") == "Hello "
    assert streamable("a < b") == "a < b"


def test_a_call_is_a_call_once_its_arguments_close():
    """The length cut after a call's arguments keeps the call; a cut inside them drops the
    call's text and says so; a second call cut keeps the first."""
    use = ToolUse(TOOLS, parse=True)
    whole = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for text in (whole[: -len("\n</tool_call>")], whole[: -len("}\n</tool_call>")]):
        parsed = use.parse_text(text, at_length=True)
        assert [n for _, n, _ in parsed.calls] == ["get_time"] and not parsed.cut, text
        assert parsed.content is None
    cut = use.parse_text(whole + '\n<tool_call>\n{"name": "get_time", "argu', at_length=True)
    assert [n for _, n, _ in cut.calls] == ["get_time"] and cut.cut and cut.content is None
    # cut inside a tag after a whole call: the call kept, no tag text, ``length``
    for tail in ("\n<tool_call", "\n<", "\n<tool_call>\n"):
        cut = use.parse_text(whole + tail, at_length=True)
        assert [n for _, n, _ in cut.calls] == ["get_time"] and cut.cut, tail
        assert cut.content is None, tail
    own = use.parse_text(whole[: -len("call>")], at_length=True)  # its own closing tag cut
    assert [n for _, n, _ in own.calls] == ["get_time"] and own.cut and own.content is None
    partial = 'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert use.parse_text(partial, at_length=True) == ParsedCalls("Let me see.", [], True)
    # not cut by length (the model stopped): text it did not finish as a call stays content
    assert use.parse_text(partial).content == partial and not use.parse_text(partial).cut
    # a forced call: the head rendered in the prompt, the sample only its arguments
    forced = ToolUse(TOOLS, parse=True, prefix=call_head("get_weather"))
    parsed = forced.parse_text('{"city": "Paris", "days": 2}')
    assert [(n, json.loads(a)) for _, n, a in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    assert forced.streamable('{"city": "Pa') == ""  # nothing of a forced call is content


def test_compiling_a_grammar_does_not_stall_other_requests(server, monkeypatch):
    """The compile is held until a plain request has finished: the engine loop kept running."""
    import threading

    from pagedkv.engine.structured import grammar

    release, entered = threading.Event(), threading.Event()
    real = grammar._grammar

    def held(spec):
        entered.set()
        assert release.wait(60), "never released"
        return real(spec)

    monkeypatch.setattr(grammar, "_grammar", held)
    schema = {"type": "object", "properties": {"held": {"type": "boolean"}},
              "required": ["held"], "additionalProperties": False}  # fmt: skip
    answer: dict = {}
    body = {"model": MODEL_NAME, "messages": ASK, "guided_json": schema, "max_tokens": 50}
    waiting = threading.Thread(target=lambda: answer.update(
        r=httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)))  # fmt: skip
    waiting.start()
    assert entered.wait(30)  # the constrained request is compiling now
    plain = httpx.post(f"{server}/v1/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 4})  # fmt: skip
    assert plain.status_code == 200 and not answer  # served while the compile still waits
    release.set()
    waiting.join(60)
    assert json.loads(answer["r"].json()["choices"][0]["message"]["content"]) in (
        {"held": True},
        {"held": False},
    )


def test_vllm_json_options_reach_every_json_constraint(tiny_2k_loaded):
    """``structured_outputs.disable_additional_properties: false`` restores JSON Schema's
    default and ``disable_any_whitespace`` the compact form, for ``response_format`` and for
    forced calls' arguments alike; unset, objects are closed and blanks allowed."""
    from pagedkv.server.protocol import ChatCompletionRequest
    from pagedkv.server.structured_params import structured_output
    from pagedkv.server.tools import tool_use

    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": open_schema}}
    named = {"type": "function", "function": {"name": "get_time"}}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": open_schema}}]
    tokenizer = tiny_2k_loaded[2]
    for options, is_open, blanks in [({}, False, True),
                                     ({"disable_additional_properties": False,
                                       "disable_any_whitespace": True}, True, False)]:  # fmt: skip
        extra = {"structured_outputs": options} if options else {}
        req = ChatCompletionRequest(messages=ASK, response_format=fmt, **extra)
        spec = structured_output(req)
        assert (spec.open_objects, spec.whitespace) == (is_open, blanks)
        req = ChatCompletionRequest(messages=ASK, tools=tools, tool_choice=named, **extra)
        _, grammar = tool_use(req, tokenizer)
        assert ('"additionalProperties": false' in grammar.spec) is not is_open
        assert ('"whitespace_flexible": true' in grammar.spec) is blanks
