"""Chat templates: compiling one (sandboxed jinja2) and finding what in a rendered chat came
from message contents, so that ``Tokenizer.encode_chat`` can keep users from typing special
tokens."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol


class ChatRenderer(Protocol):
    """What finding content spans needs of a tokenizer: rendering a chat to text
    (``Tokenizer`` satisfies it). A protocol here, so that this module does not import the
    tokenizer module that imports it."""

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str: ...


def render_with_content_spans(
    tokenizer: ChatRenderer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans in it that came from message contents.

    The template is rendered a second time with a unique sentinel in place of each string
    content; the text between sentinels is the template's own. A template that rewrites a
    content (e.g. ``| trim``) is matched with the stripped content; one that rewrites it in
    any other way gets the raw content in its slot (the text then differs from
    ``apply_chat_template`` only inside that content). A template that drops or mangles the
    sentinels keeps its own text, with each content found by a left-to-right search.
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt, tools)
    nonce = secrets.token_hex(8)
    contents: list[str] = []
    marked: list[Mapping[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and content:
            marked.append({**message, "content": f"\ue000{nonce}:{len(contents)}\ue001"})
            contents.append(content)
        else:
            marked.append(message)
    if not contents:
        return text, []
    skeleton = tokenizer.apply_chat_template(marked, add_generation_prompt, tools)
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", skeleton)
    rebuilt, spans = _fill(pieces, contents, str)
    if rebuilt != text:
        stripped, stripped_spans = _fill(pieces, contents, str.strip)
        if stripped == text:
            rebuilt, spans = stripped, stripped_spans
        elif set(pieces[1::2]) != {str(i) for i in range(len(contents))}:
            return text, _find_in_order(text, contents)
    return rebuilt, spans


def _find_in_order(text: str, contents: list[str]) -> list[tuple[int, int]]:
    spans, at = [], 0
    for content in contents:
        found = text.find(content, at)
        if found != -1:
            spans.append((found, found + len(content)))
            at = found + len(content)
    return spans


def _fill(
    pieces: list[str], contents: list[str], rewrite: Callable[[str], str]
) -> tuple[str, list[tuple[int, int]]]:
    """``pieces`` from splitting on sentinels (text, index, text, ...) with the contents put
    back (after ``rewrite``); returns the text and each content's span in it."""
    parts, spans, at = [pieces[0]], [], len(pieces[0])
    for k in range(1, len(pieces), 2):
        content = rewrite(contents[int(pieces[k])])
        spans.append((at, at + len(content)))
        parts += [content, pieces[k + 1]]
        at += len(content) + len(pieces[k + 1])
    return "".join(parts), spans


def overlaps(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    return any(start < span_end and span_start < end for span_start, span_end in spans)


def compile_template(template: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    # Chat templates are written for this whitespace handling (as in the HF tokenizers).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    # Some templates (Llama 3.x) print today's date.
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
