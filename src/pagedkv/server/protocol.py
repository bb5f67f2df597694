"""The OpenAI wire format: pydantic models of the requests we accept and the bodies we send.

Requests are validated strictly (JSON types as sent: ``"5"`` is not an integer); nested objects
refuse unknown keys, and a request's top-level fields beyond these follow
``server/unknown_fields.py``. OpenAI fields we do not implement
(``suffix``, ``best_of``) are declared so that clients sending their neutral defaults
keep working; any other value is refused in ``request_params.py``.
Responses are plain models dumped to JSON; their shapes follow OpenAI's so that the official
client parses them unchanged. Every float a response carries is a log-probability, and JSON has
no infinity: ``Logprob`` is the one rule that writes them (``finite_logprob``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PlainSerializer

from pagedkv.server.protocol_base import Request as _Request
from pagedkv.server.protocol_base import Strict as _Strict
from pagedkv.server.protocol_messages import ChatMessage
from pagedkv.server.protocol_tools import (
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    Tool,
)

# -- requests ------------------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk (with include_usage)


class _SamplingFields(_Request):
    """Fields shared by both generation routes. ``top_k``, ``cache_salt``, ``ignore_eos`` and
    ``stop_token_ids`` are the vLLM extensions (clients send them through ``extra_body``)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extensions
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    # structured output (server/structured_params.py): OpenAI's, then vLLM's two spellings
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: text, token ids, or a batch of either; each prompt
    of a batch yields ``n`` choices (index ``prompt_index * n + sample``). ``logprobs``: the
    number of top alternatives per token (0 = the chosen token only). ``echo`` and
    ``prompt_logprobs``: ``server/echo.py``; ``max_tokens: 0`` only with ``echo``."""

    prompt: PromptInput
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is OpenAI's newer name for
    ``max_tokens``; giving both is an error. ``logprobs`` is a flag here and ``top_logprobs``
    the number of alternatives."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


# -- responses -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


LOGPROB_FLOOR = -9999.0  # vLLM's floor for a token of probability 0 (-inf in float32)


def finite_logprob(value: float) -> float:
    """``value`` as JSON can carry it: -inf (and NaN) become ``LOGPROB_FLOOR``."""
    return value if math.isfinite(value) else (0.0 if value > 0 else LOGPROB_FLOOR)


Logprob = Annotated[float, PlainSerializer(finite_logprob, return_type=float)]


class CompletionLogprobs(BaseModel):
    """The legacy completions layout: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Logprob | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: per prompt token None or {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class OutFunctionCall(BaseModel):
    name: str
    arguments: str


class OutToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OutFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[OutToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: OutFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedkv"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def dump(model: BaseModel) -> dict[str, Any]:
    """The JSON object of a response model (``None`` fields kept: OpenAI sends them too)."""
    return model.model_dump(mode="json")
