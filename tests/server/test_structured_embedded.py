"""Structured output on the embedded SmolLM2 as real clients drive it (issue 48): the official
``openai`` client and LangChain's ``ChatOpenAI``, two implementations nobody here wrote, at
greedy decoding. JSON mode closes; forced calls on open schemas (what LangChain and most users
send) come back as parsed ``tool_calls`` within small token budgets; a cut call says
``length`` and shows no wrapper text; the client's own replay of a message is accepted;
logprobs' bytes rebuild the answer byte for byte."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from .conftest import MODEL_NAME, running_server

ENGINE = dict(max_model_len=1024, kv_cache_memory_bytes=128 << 20)
JSON_PROMPTS = [
    "Return a JSON object with key a equal to 1.",  # the issue's: it counted to max_tokens
    "Give me a JSON object describing a cat with its name and age.",
    "List three fruits as a JSON object.",
]
# Open schemas: additionalProperties unset, as LangChain and most users write them.
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
     "description": "Get the weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time",
     "description": "The time in a time zone", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(embedded):
    with running_server(embedded, **ENGINE) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as c:
        yield c


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL_NAME, temperature=0, **kw)


def closed(schema: dict) -> dict:
    return {**schema, "additionalProperties": False}


@pytest.mark.parametrize("prompt", JSON_PROMPTS)
def test_json_mode_closes_within_48_tokens(client, prompt):
    r = chat(client, messages=[{"role": "user", "content": prompt}], max_tokens=48,
             response_format={"type": "json_object"})  # fmt: skip
    (c,) = r.choices
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(json.loads(c.message.content), dict)


def test_langchain_json_mode_returns_the_object(server):
    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model=MODEL_NAME,
                     temperature=0, max_tokens=48)  # fmt: skip
    # LangChain raises LengthFinishReasonError when the object does not close
    assert llm.with_structured_output(method="json_mode").invoke(JSON_PROMPTS[0]) == {"a": 1}


@pytest.mark.parametrize(
    "tools, choice",
    [(TOOLS[:1], {"type": "function", "function": {"name": "get_weather"}}),
     (TOOLS, {"type": "function", "function": {"name": "get_time"}}),
     (TOOLS[:1], "required"), (TOOLS, "required")],
)  # fmt: skip
def test_forced_calls_on_open_schemas_are_parsed_calls(client, tools, choice):
    r = chat(client, messages=ASK, tools=tools, tool_choice=choice, max_tokens=64)
    (c,) = r.choices
    assert c.message.content is None and c.message.tool_calls, c
    for call in c.message.tool_calls:  # the object closed where the schema left it open
        jsonschema.validate(
            json.loads(call.function.arguments), closed(SCHEMAS[call.function.name])
        )
    if isinstance(choice, dict):
        (call,) = c.message.tool_calls
        assert call.function.name == choice["function"]["name"] and c.finish_reason == "tool_calls"
        assert r.usage.completion_tokens <= 16  # the arguments only: the wrapper was rendered
    else:  # more calls may follow: a third cut at 64 tokens is dropped and says so
        assert c.finish_reason in ("tool_calls", "length")


class WeatherArgs(BaseModel):
    """The weather in a city."""

    city: str


def test_langchain_forced_call_fits_24_tokens(server):
    """LangChain's forced call on a pydantic schema (no additionalProperties) at the budget
    where a whole generated wrapper ran out one character short."""
    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model=MODEL_NAME,
                     temperature=0, max_tokens=24)  # fmt: skip
    reply = llm.bind_tools([WeatherArgs], tool_choice="WeatherArgs").invoke(ASK[0]["content"])
    (call,) = reply.tool_calls
    assert call["name"] == "WeatherArgs" and isinstance(call["args"]["city"], str)
    parsed = llm.with_structured_output(WeatherArgs, method="function_calling").invoke(
        ASK[0]["content"]
    )
    assert isinstance(parsed, WeatherArgs)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_a_call_cut_by_the_length_limit_says_length_and_shows_no_wrapper(client, choice):
    r = chat(client, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=4)
    (c,) = r.choices
    assert c.finish_reason == "length" and c.message.content is None and not c.message.tool_calls
    chunks = list(chat(client, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=4,
                       stream=True))  # fmt: skip
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_clients_own_replay_is_accepted(client):
    r = chat(client, messages=ASK, tools=TOOLS[:1], tool_choice="required", max_tokens=16,
             parallel_tool_calls=False)  # fmt: skip
    message = r.choices[0].message  # refusal, audio, function_call, annotations: all None
    (call,) = message.tool_calls
    turns = ASK + [message, {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    assert chat(client, messages=turns, tools=TOOLS[:1], max_tokens=4).choices[0].finish_reason
    nulls = {"role": "assistant", "content": "Hello.", "refusal": None, "audio": None,
             "function_call": None, "annotations": [], "name": None, "tool_calls": None}  # fmt: skip
    replay = [{"role": "user", "content": "Hi", "name": None}, nulls,
              {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]  # fmt: skip
    assert chat(client, messages=replay, max_tokens=2).choices[0].message.content is not None


def test_what_cannot_be_honoured_is_refused_by_name(server):
    refused = [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "messages.0.content.0.type", "image_url"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "audio": {"id": "a1"}}],
         "messages.1.audio", "audio"),
    ]  # fmt: skip
    for messages, param, named in refused:
        r = httpx.post(f"{server}/v1/chat/completions", timeout=30,
                       json={"model": MODEL_NAME, "messages": messages})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert named in r.json()["error"]["message"]


def test_a_refusal_and_a_deprecated_call_are_rendered(server):
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "refusal": "I cannot help."},
                {"role": "assistant", "content": None,
                 "function_call": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
                {"role": "function", "name": "get_time", "content": "12:00"}]  # fmt: skip
    ids = httpx.post(f"{server}/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(f"{server}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "I cannot help." in text and '"name": "get_time"' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text


def whole_characters(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_logprob_bytes_rebuild_the_text_byte_for_byte(client):
    r = chat(client, messages=[{"role": "user", "content": "Send me a smiley emoji and nothing else."}],
             max_tokens=12, logprobs=True, top_logprobs=2)  # fmt: skip
    (c,) = r.choices
    tokens = c.logprobs.content
    assert b"".join(bytes(t.bytes) for t in tokens) == c.message.content.encode()
    assert any(not whole_characters(bytes(t.bytes)) for t in tokens)  # an emoji's pieces
    for entry in tokens + [a for t in tokens for a in t.top_logprobs]:
        assert entry.token == bytes(entry.bytes).decode("utf-8", errors="replace")


def test_a_second_call_cut_keeps_the_first_and_says_length(client):
    """Greedy, this model calls get_weather twice (47 tokens); at 30 the second is cut."""
    whole = chat(client, messages=ASK, tools=TOOLS[:1], tool_choice="required", max_tokens=64)
    assert len(whole.choices[0].message.tool_calls) == 2
    r = chat(client, messages=ASK, tools=TOOLS[:1], tool_choice="required", max_tokens=30)
    (c,) = r.choices
    assert c.finish_reason == "length" and c.message.content is None
    assert [t.function.arguments for t in c.message.tool_calls] == [
        whole.choices[0].message.tool_calls[0].function.arguments
    ]


@pytest.mark.parametrize("max_tokens", [17, 18])
def test_a_cut_inside_the_next_calls_tag_says_length_and_shows_no_tag(client, max_tokens):
    """Greedy, the second call's ``<tool_call>`` is being written at token 17-18 (issue 53:
    content ``"<tool_call"`` and ``tool_calls`` before)."""
    kw = dict(messages=ASK, tools=TOOLS[:1], tool_choice="required", max_tokens=max_tokens)
    (c,) = chat(client, **kw).choices
    assert c.finish_reason == "length" and c.message.content is None
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    chunks = list(chat(client, stream=True, **kw))
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
