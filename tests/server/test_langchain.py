"""LangChain's ``ChatOpenAI``, a client nobody here wrote, against the server on a tiny random
model: ``with_structured_output`` by JSON Schema and by function calling returns validated
objects, and ``bind_tools`` makes a call whose result goes back as a ``ToolMessage`` for the
next turn."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from .conftest import MODEL_NAME, running_server


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=99)


class WeatherArgs(BaseModel):
    city: str = Field(max_length=12)  # bounded: a random model's strings end late


@tool(args_schema=WeatherArgs)
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"18 C and sunny in {city}"


@pytest.fixture(scope="module")
def llm(tiny_2k_loaded):
    with running_server(tiny_2k_loaded, max_model_len=2048) as (url, _):
        yield ChatOpenAI(base_url=f"{url}/v1", api_key="none", model=MODEL_NAME,
                         temperature=1.0, max_tokens=120, seed=5)  # fmt: skip


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm, method):
    # strict: OpenAI's rule (no properties beyond the schema's), so a random model must stop
    structured = llm.with_structured_output(Person, method=method, strict=True)
    person = structured.invoke("Describe a person.")
    assert isinstance(person, Person)  # pydantic validated it against the schema


def test_bind_tools_round_trip(llm):
    ask = HumanMessage("What is the weather in Paris?")
    reply = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke([ask])
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = llm.bind_tools([get_weather]).invoke([ask, reply, result])
    assert isinstance(answer.content, str)
