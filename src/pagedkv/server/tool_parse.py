"""Reading tool calls out of a sample's text, in the Hermes/Qwen format the model writes:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

A call is a call once its arguments are complete JSON: the closing ``}`` of the wrapper and
the ``</tool_call>`` tag may be missing at the end of the text (a length cut, or a forced call
whose grammar stops after the arguments, ``server/forced_calls.py``). A call begun but cut
before its arguments closed is dropped from the content when the sample ended by length, and
reported (``ParsedCalls.cut``), so the answer says ``length`` and shows no wrapper text; so is a
tag cut short after a whole call (``<tool_call`` of a next call, ``</tool_`` of its own). Any
other ``<tool_call>`` that does not read as a call to an offered function stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The head of a call whose wrapper was cut after its arguments: {"name": "x", "arguments":
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCalls:
    content: str | None  # the text outside the calls (None when nothing else)
    calls: list[tuple[str, str, str]]  # (call id, function name, arguments as JSON text)
    cut: bool = False  # a call was cut by the length limit before its arguments closed


def parse_calls(text: str, names: Collection[str], at_length: bool = False) -> ParsedCalls:
    """The calls in ``text`` to functions in ``names``; ``at_length``: the sample ended by
    its length limit (a trailing unfinished call is then dropped, and ``cut`` set)."""
    calls: list[tuple[str, str, str]] = []
    kept: list[str] = []
    at = search = 0
    cut = False
    while (start := text.find(OPEN, search)) >= 0:
        found = _read_call(text, _skip_blanks(text, start + len(OPEN)))
        if found is None:
            if at_length and CLOSE not in text[start:]:  # being written when the cut came
                kept.append(text[at:start])
                at, cut = len(text), True
                break
            search = start + len(OPEN)  # not a call we can read: it stays in the content
            continue
        name, args, end = found
        if name not in names or not isinstance(args, dict):
            search = start + len(OPEN)
            continue
        kept.append(text[at:start])
        at = search = end
        calls.append((f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args)))
    rest = text[at:]
    if at_length and calls and _ends_in_cut_tag(text):  # cut inside a wrapper's tag
        cut = True
        rest = "" if _cut_tag(rest) else rest  # a next call's ``<tool_call`` is no content
    kept.append(rest)
    content = "".join(kept).strip() if calls or cut else text
    return ParsedCalls(content or None, calls, cut)


def _ends_in_cut_tag(text: str) -> bool:
    tail = text.rstrip()
    return any(tail.endswith(tag[:k]) for tag in (OPEN, CLOSE) for k in range(1, len(tag)))


def _cut_tag(text: str) -> bool:
    """Whether ``text`` (blanks aside) is a tag cut short: a proper, non-empty prefix of
    ``<tool_call>`` or ``</tool_call>``."""
    tail = text.strip()
    return bool(tail) and any(tag.startswith(tail) and tag != tail for tag in (OPEN, CLOSE))


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


def _read_call(text: str, i: int) -> tuple[Any, Any, int] | None:
    """(name, arguments, end of the call's text) of the call body at ``text[i:]``, or None.
    Whole: a JSON object, then ``</tool_call>`` or the end of the text. Cut after its
    arguments: ``{"name": ..., "arguments": {...}`` and then the end of the text."""
    try:
        call, j = _DECODER.raw_decode(text, i)
    except ValueError:
        call = None
    if isinstance(call, dict):
        k = _skip_blanks(text, j)
        if text.startswith(CLOSE, k):
            end = k + len(CLOSE)
        elif k == len(text) or _cut_tag(text[k:]):  # its closing tag missing, or cut short
            end = len(text)
        else:
            return None
        name, args = call.get("name"), call.get("arguments", call.get("parameters", {}))
        return (name, args, end) if isinstance(name, str) else None
    head = _HEAD.match(text, i)
    if head is None:
        return None
    try:
        args, j = _DECODER.raw_decode(text, head.end())
    except ValueError:
        return None
    if _skip_blanks(text, j) != len(text):
        return None
    return json.loads(head.group(1)), args, len(text)


def _skip_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
