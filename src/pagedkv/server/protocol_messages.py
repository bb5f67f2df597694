"""The request model of a chat turn: every field of OpenAI's message schema, strict like the
rest of ``protocol.py``. What each field does to the prompt is ``server/tools.py``'s to say."""

from __future__ import annotations

from typing import Any, Literal

from pagedkv.server.protocol_base import Request as _Request
from pagedkv.server.protocol_base import Strict as _Strict
from pagedkv.server.protocol_tools import FunctionCall, ToolCall


class ContentPart(_Request):
    """One part of a message's content. Any ``type`` is read here (an image's payload
    included) so that ``server/tools.py`` can refuse a non-text part by its type."""

    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's part of type "refusal"


class ChatMessage(_Strict):
    """A turn, with every field of OpenAI's message schema (``server/tools.py`` renders it or
    refuses what it cannot render). ``tool_calls``: what an assistant turn called; ``role:
    "tool"`` with ``tool_call_id``: a call's result, sent back in a later request;
    ``function_call`` and ``role: "function"``: the deprecated forms of both."""

    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    function_call: FunctionCall | None = None
    audio: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None
