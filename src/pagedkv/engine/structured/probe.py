"""Whether a compiled grammar can run, judged before its request is admitted.

llguidance compiles a grammar lazily: its lexer builds states as tokens arrive, so a grammar that
validates can still fail at its first token (``a{1000000}``: "too many expressions constructed")
or admit nothing at all (``{"$ref": "#"}``, ``start: start``, ``[^\\s\\S]``: its matcher is in
error before the first token). Left to the step, such a request used to fail inside the engine
with the parser's state in its message, or end at once with empty text. So a spec passes three
checks first, each a bound the step could not otherwise keep:

- **size**: no counted repetition above ``MAX_REPEAT`` in a regex, a schema's ``pattern`` or a
  grammar (the lexer builds one expression per count; at ~300,000 it runs out, and from ~10,000
  each mask takes milliseconds);
- **a first token**: the first mask admits some token, and not only end-of-sequence where the
  output must have content (JSON, a choice, a tool call);
- **a walk**: masks computed along the lowest allowed token for ``PROBE_STEPS`` tokens without
  error.

Time is bounded by llguidance's own fuel (``limits``: lexer fuel at build and per mask, Earley
items per step), which fails a grammar deterministically; a wall-clock bound would refuse a
schema on a busy machine and admit it on a quiet one (a JSON-mode grammar's first mask, which
builds its lexer over the vocabulary, took 273 ms under a loaded test run).

The walk explores one path; a grammar that fails deeper still fails its own sample only
(``GrammarError``, contained by ``step/draws.collect``).
"""

from __future__ import annotations

import re
from typing import Any

from pagedkv.engine.structured.spec import StructuredOutput

MAX_ERROR_CHARS = 300
MAX_REPEAT = 10_000
PROBE_STEPS = 16
# Kinds whose output has content: one that admits only end-of-sequence is a mistake.
CONTENT_KINDS = ("json", "json_object", "choice", "lark")
_COUNTED = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def limits() -> Any:
    """llguidance's fuel and size limits (its defaults), with errors that do not dump the
    parser's internal state into a client's message."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def reason(matcher: Any) -> str:
    """The matcher's error as one short line (without llguidance's ``<non-verbose/>`` tag)."""
    return one_line(matcher.get_error()) or "the grammar failed"


def one_line(text: str) -> str:
    return " ".join(text.replace("<non-verbose/>", "").split())[:MAX_ERROR_CHARS]


def oversized(spec: StructuredOutput, schema: Any = None) -> str:
    """Why ``spec`` is too large to compile ("" when it is not): a counted repetition above
    ``MAX_REPEAT`` in its regex, grammar or (``schema``, the parsed JSON) patterns."""
    if spec.kind in ("regex", "grammar", "lark"):
        texts = [spec.spec]
    elif spec.kind == "json":
        texts = list(_patterns(schema))
    else:
        texts = []
    for text in texts:
        for m in _COUNTED.finditer(text):
            if max(int(m.group(1)), int(m.group(2) or 0)) > MAX_REPEAT:
                return f"its counted repetition {m.group(0)} exceeds {MAX_REPEAT:,}"
    return ""


def _patterns(node: Any):
    """Every regex a JSON Schema holds: ``pattern`` values and ``patternProperties`` keys."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from (k for k in value if isinstance(k, str))
            yield from _patterns(value)
    elif isinstance(node, list):
        for value in node:
            yield from _patterns(value)


def probe(prototype: Any, eos_token_id: int | None, needs_content: bool) -> str:
    """Why a copy of ``prototype`` cannot run ("" when it can): the first token and walk checks
    of the module docstring."""
    matcher = prototype.deep_copy()
    eos_bit = 0 if eos_token_id is None else 1 << eos_token_id
    for step in range(PROBE_STEPS):
        allowed = int.from_bytes(matcher.compute_bitmask(), "little")
        if matcher.is_error():
            why = reason(matcher)
            return f"it admits no first token ({why})" if step == 0 else why
        if not allowed:
            return "it admits no token"
        content = allowed & ~eos_bit
        if not content:  # only the end: an empty answer, or a complete one
            return "it admits no output" if step == 0 and needs_content else ""
        if matcher.is_stopped():
            return ""
        if not matcher.consume_token((content & -content).bit_length() - 1):
            return reason(matcher)
    return ""
