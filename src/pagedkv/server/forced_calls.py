"""Forced tool calls (``tool_choice`` ``required`` or naming a function): what the prompt
already says, and the grammar of what the model must still write.

The call's wrapper is not the model's to choose: with one function the whole head
``<tool_call>\\n{"name": "f", "arguments": `` is rendered after the generation prompt and the
model writes only the arguments (on the embedded model 6-15 tokens a call instead of 32-40,
so a call fits LangChain's ``max_tokens=24``); with several, ``<tool_call>\\n{"name": "`` is
rendered and the model picks the name. The grammar stops the sample once the arguments close
(one call), or lets it close the wrapper and write further calls (``required`` with parallel
calls). ``server/tool_parse.py`` reads the rendered head and the sample's text together.

The head is rendered only where the chat template's call format is known to be this one
(``hermes_format``): the server's own tool prompt, or a template that writes ``<tool_call>``
(Qwen2.5, Hermes). For any other template the grammar generates the head instead, as before.
Arguments follow the function's parameter schema under ``engine/structured/json_schema.py``'s rules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.structured.json_schema import guidance_schema
from pagedkv.engine.structured.spec import StructuredOutput
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.structured_params import JsonRules
from pagedkv.server.tool_parse import CLOSE, OPEN

NAME_HEAD = OPEN + '\n{"name": "'  # rendered when the model must pick among functions
NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: no parameters = an empty list


@dataclass(frozen=True)
class ForcedCalls:
    """``prefix``: the text rendered after the generation prompt ("" when the format is
    unknown); ``grammar``: what the sample must match after it."""

    prefix: str
    grammar: StructuredOutput


def hermes_format(tokenizer: Tokenizer) -> bool:
    """Whether the model is told to write calls as ``<tool_call>{...}</tool_call>``: by the
    server (a template that does not render tools) or by its own template."""
    return not tokenizer.renders_tools or OPEN in (tokenizer.chat_template or "")


def call_head(name: str) -> str:
    """A call's text up to its arguments, as ``server/tools.py`` renders past calls."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": '


def forced_calls(
    tools: list[dict[str, Any]],
    many: bool,
    rendered: bool,
    rules: JsonRules,
    indices: list[int] | None = None,
) -> ForcedCalls:
    """One call to one of ``tools`` (OpenAI's ``{type, function}`` dicts), or one or more
    when ``many``; the head rendered when ``rendered`` (``hermes_format``). ``indices``: each
    tool's position in the request's ``tools`` (errors name ``tools.i.function.parameters``;
    default: their order here)."""
    heads, bodies, parts = [], [], []
    for t, i in zip(tools, indices or range(len(tools)), strict=True):
        fn = t["function"]
        parameters = fn.get("parameters") or NO_PARAMETERS
        schema = guidance_schema(
            parameters, open_objects=rules.open_objects, whitespace=rules.whitespace
        )
        heads.append(call_head(fn["name"]))
        bodies.append(f"%json {json.dumps(schema)}")
        param = f"tools.{i}.function.parameters"
        parts.append(
            StructuredOutput.of_schema(parameters, param, rules.open_objects, rules.whitespace)
        )
    call = " | ".join(f"{_lark(h)} {b}" for h, b in zip(heads, bodies, strict=True))
    if not rendered:
        prefix, first = "", call
    elif len(tools) == 1:
        prefix, first = heads[0], bodies[0]
    else:
        prefix = NAME_HEAD
        first = " | ".join(
            f"{_lark(h[len(prefix) :])} {b}" for h, b in zip(heads, bodies, strict=True)
        )
    close, between = _lark("}\n" + CLOSE), _lark("}\n" + CLOSE + "\n")
    start = f"first ({between} call)* {close}?" if many else "first"
    grammar = f"start: {start}\nfirst: {first}\ncall: {call}\n"
    return ForcedCalls(prefix, StructuredOutput("lark", grammar, "tools", parts=tuple(parts)))


def _lark(text: str) -> str:
    """A Lark string literal (it takes JSON's escapes)."""
    return json.dumps(text)
