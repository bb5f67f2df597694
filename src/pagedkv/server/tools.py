"""Tool calling on the chat route: tools and past turns into the prompt, calls out of the text.

The wire format is the Hermes/Qwen one: the model writes each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A chat template that reads
``tools`` (Qwen2.5, Hermes) renders the tools, the assistant's calls and the tool results
itself; for one that does not (SmolLM2's), the same format is written into the messages: the
tool list and the instructions in the system turn, calls as the assistant's text, results as
``<tool_response>`` in a user turn.

``tool_choice``: ``none`` returns text (tools still shown); ``auto`` parses whatever calls the
model wrote (``server/tool_parse.py``); ``required`` and a named function force calls
(``server/forced_calls.py``: the wrapper rendered, the arguments constrained by the function's
JSON Schema), so a parse cannot fail.

Past turns carry every field of OpenAI's message schema, as its client replays them: a field
that does not change the prompt is accepted (``refusal``, ``audio``, ``function_call``,
``annotations`` null or empty; ``annotations`` describe a message, never a prompt), what pagedkv
can render is rendered (a ``refusal`` text, a deprecated ``function_call`` and ``role:
"function"`` result), and what it cannot (audio, images, files) is a 400 naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.structured.spec import StructuredOutput
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.errors import APIError
from pagedkv.server.forced_calls import forced_calls, hermes_format
from pagedkv.server.protocol import ChatCompletionRequest
from pagedkv.server.protocol_messages import ChatMessage, ContentPart
from pagedkv.server.structured_params import json_rules
from pagedkv.server.tool_parse import CLOSE, OPEN, ParsedCalls, parse_calls, streamable

_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described in JSON Schema within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nFor each "
    "function call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


@dataclass(frozen=True)
class ToolUse:
    """The request's tools (OpenAI's ``{type, function}`` dicts), whether to parse calls, and
    ``prefix``: the start of a forced call rendered after the prompt (the sample continues
    it)."""

    tools: list[dict[str, Any]]
    parse: bool
    prefix: str = ""

    def parse_text(self, text: str, at_length: bool = False) -> ParsedCalls:
        """The calls in the sample's ``text`` (after ``prefix``) to functions the request
        offered; ``at_length``: the sample was cut by its length limit."""
        names = {t["function"]["name"] for t in self.tools}
        return parse_calls(self.prefix + text, names, at_length)

    def streamable(self, text: str) -> str:
        """What of the sample's ``text`` so far is content for sure (none of a forced call)."""
        return streamable(self.prefix + text)[len(self.prefix) :]


def tool_use(
    req: ChatCompletionRequest, tokenizer: Tokenizer
) -> tuple[ToolUse | None, StructuredOutput | None]:
    """(how the answer treats calls, the grammar that forces calls); ``APIError``."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None, None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice or "auto"
    if choice == "none":
        return ToolUse(tools, parse=False), None
    if choice == "auto":
        return ToolUse(tools, parse=True), None
    if choice == "required":
        indices, many = list(range(len(tools))), req.parallel_tool_calls is not False
    else:
        indices = [i for i, t in enumerate(tools) if t["function"]["name"] == choice.function.name]
        if not indices:
            raise APIError(
                f"tool_choice names {choice.function.name!r}, which is not in tools",
                param="tool_choice.function.name",
                code="invalid_value",
            )
        many = False
    offered = [tools[i] for i in indices]
    forced = forced_calls(offered, many, hermes_format(tokenizer), json_rules(req), indices)
    return ToolUse(tools, parse=True, prefix=forced.prefix), forced.grammar


def tool_messages(
    messages: list[ChatMessage], use: ToolUse | None, template_renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(the messages as the template gets them, the ``tools`` argument or None);
    ``APIError`` naming a field pagedkv cannot render."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = _text(m, i)
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)  # newer, older
        entry: dict[str, Any] = {"role": role, "content": content}
        called = [c.function for c in m.tool_calls or []]
        if m.function_call is not None:  # the deprecated single call
            called.append(m.function_call)
        paths = _call_params(m, i)
        calls = [
            {"name": f.name, "arguments": _arguments(f.arguments, at)}
            for f, at in zip(called, paths, strict=True)
        ]
        if template_renders_tools:
            if calls:
                entry["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            elif m.role == "function" and m.name is not None:
                entry["name"] = m.name
        elif calls:  # the calls as the model wrote them
            blocks = [f"{OPEN}\n{json.dumps(c)}\n{CLOSE}" for c in calls]
            entry["content"] = "\n".join(([content] if content else []) + blocks)
        elif role == "tool":
            entry = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        out.append(entry)
    if use is None or template_renders_tools:
        return out, use.tools if use is not None else None
    listing = "\n".join(json.dumps(t) for t in use.tools)
    system = _SYSTEM.format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def _text(m: ChatMessage, i: int) -> str:
    """The message's text: its content (text parts joined), else its refusal; ``APIError``
    for what has no text form here."""
    if m.audio is not None:
        raise APIError(
            "an assistant's audio cannot be replayed: pagedkv's models read text "
            "(send the transcript as content)",
            param=f"messages.{i}.audio",
            code="unsupported",
        )
    if m.refusal and m.role != "assistant":
        raise APIError(
            "refusal belongs to assistant messages",
            param=f"messages.{i}.refusal",
            code="invalid_value",
        )
    content = m.content
    if isinstance(content, list):
        content = "".join(_part_text(part, i, j) for j, part in enumerate(content))
    return content or m.refusal or ""


def _part_text(part: ContentPart, i: int, j: int) -> str:
    if part.type == "text" and part.text is not None:
        return part.text
    if part.type == "refusal" and part.refusal is not None:
        return part.refusal
    param = f"messages.{i}.content.{j}"
    if part.type in ("text", "refusal"):
        raise APIError(
            f"a content part of type {part.type!r} needs its {part.type} field",
            param=f"{param}.{part.type}",
            code="invalid_value",
        )
    raise APIError(
        f"content parts of type {part.type!r} are not supported: pagedkv's models "
        "read text (send parts of type 'text')",
        param=f"{param}.type",
        code="unsupported",
    )


def _call_params(m: ChatMessage, i: int) -> list[str]:
    """The field path of each call's arguments in message ``i`` (``tool_calls`` first, then
    the deprecated ``function_call``), as errors name them."""
    paths = [
        f"messages.{i}.tool_calls.{j}.function.arguments" for j in range(len(m.tool_calls or []))
    ]
    if m.function_call is not None:
        paths.append(f"messages.{i}.function_call.arguments")
    return paths


def _arguments(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise APIError(
            "a tool call's arguments must be JSON text", param=param, code="invalid_value"
        ) from None
