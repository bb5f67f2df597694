"""Tool calling on the chat route: tools into the prompt, calls out of the text.

The wire format is the Hermes/Qwen one: the model writes each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A chat template that reads
``tools`` (Qwen2.5, Hermes) renders the tools, the assistant's calls and the tool results
itself; for one that does not (SmolLM2's), the same format is written into the messages: the
tool list and the instructions in the system turn, calls as the assistant's text, results as
``<tool_response>`` in a user turn.

``tool_choice``: ``none`` returns text (tools still shown); ``auto`` parses whatever calls the
model wrote; ``required`` and a named function constrain the output with a grammar
(``StructuredOutput`` of kind ``lark``) to one or more calls (one when
``parallel_tool_calls`` is false, or for a named function), whose arguments follow the
function's JSON Schema, so a parse cannot fail.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.structured import StructuredOutput
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import ChatCompletionRequest, ChatMessage

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described in JSON Schema within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nFor each "
    "function call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


@dataclass(frozen=True)
class ParsedCalls:
    content: str | None  # the text outside the calls (None when only calls)
    calls: list[tuple[str, str, str]]  # (call id, function name, arguments as JSON text)


@dataclass(frozen=True)
class ToolUse:
    """The request's tools (OpenAI's ``{type, function}`` dicts) and whether to parse calls."""

    tools: list[dict[str, Any]]
    parse: bool

    def parse_text(self, text: str) -> ParsedCalls:
        """The calls in ``text`` to functions the request offered; anything else stays text."""
        names = {t["function"]["name"] for t in self.tools}
        calls, kept, at = [], [], 0
        for m in _CALL.finditer(text):
            try:
                call = json.loads(m.group(1))
                name, args = call["name"], call.get("arguments", call.get("parameters", {}))
            except (ValueError, KeyError, TypeError):
                continue  # not a call we can read: it stays in the content
            if name not in names or not isinstance(args, dict):
                continue
            kept.append(text[at : m.start()])
            at = m.end()
            calls.append((f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args)))
        kept.append(text[at:])
        content = "".join(kept).strip() if calls else text
        return ParsedCalls(content or None, calls)

    @staticmethod
    def streamable(text: str) -> str:
        """The prefix of ``text`` that is content for sure: before any call, and without an
        ending that could still become ``<tool_call>``."""
        cut = text.find(OPEN)
        if cut >= 0:
            return text[:cut]
        for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
            if OPEN.startswith(text[-k:]):
                return text[:-k]
        return text


def tool_use(req: ChatCompletionRequest) -> tuple[ToolUse | None, StructuredOutput | None]:
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
        offered, many = tools, req.parallel_tool_calls is not False
    else:
        offered = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not offered:
            raise APIError(f"tool_choice names {choice.function.name!r}, which is not in tools",
                           param="tool_choice.function.name", code="invalid_value")  # fmt: skip
        many = False
    return ToolUse(tools, parse=True), _calls_grammar(offered, many)


def _calls_grammar(tools: list[dict[str, Any]], many: bool) -> StructuredOutput:
    """A Lark grammar (llguidance's ``%json`` embeds a JSON Schema) of one or more calls."""
    variants = [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": t["function"]["name"]},
                        "arguments": t["function"].get("parameters") or {"type": "object"}}}
        for t in tools
    ]  # fmt: skip
    # No free whitespace inside the JSON, as for every structured output (engine/grammar.py).
    schema = {"anyOf": variants, "x-guidance": {"whitespace_flexible": False}}
    call = f'"{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
    start = 'call ("\\n" call)*' if many else "call"
    return StructuredOutput("lark", f"start: {start}\ncall: {call}\n", param="tools")


def tool_messages(
    messages: list[ChatMessage], use: ToolUse | None, template_renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(the messages as the template gets them, the ``tools`` argument or None)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                 for c in m.tool_calls or []]  # fmt: skip
        if template_renders_tools:
            if calls:
                entry["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
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


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise APIError("a tool call's arguments must be JSON text", param="messages",
                       code="invalid_value") from None  # fmt: skip
