"""The JSON a constrained sample may write: which keys an object schema admits, and where
blanks may go. Pure Python (no llguidance): ``engine/structured/grammar.py`` and the server's tool-call
grammars (``server/forced_calls.py``) both build their JSON grammars from ``guidance_schema``,
so every JSON pagedkv constrains follows the same two rules.

**Objects are closed unless the schema opens them.** An object schema that lists
``properties`` but leaves ``additionalProperties`` unset admits only its listed keys, as vLLM's
default backend (xgrammar's strict mode) reads it. JSON Schema's own default admits any other
key, and a small model takes that licence: a forced call on an open schema kept adding keys
(``{"city":"Paris","properties":{...``) until ``max_tokens`` (3 of 3 prompts; closed, all three
ended in 27-28 tokens). ``open_objects=True`` restores JSON Schema's reading. A schema whose
keys are composed from several places (``allOf``, or ``properties`` beside ``anyOf``/``oneOf``
/``$ref``) is left as written: closing one part would forbid the keys of another.

**Bounded blanks on one line.** Between two JSON tokens at most ``MAX_BLANK_CHARS`` spaces or
tabs: a model that learned ``json.dumps`` (``", "``, ``": "``) stays on its own distribution,
and no sample can loop on blanks. No line breaks: pretty-printing spends a token or two per
line, and on the embedded model it closed 19 of 32 JSON-mode answers within 48 tokens against
27 of 32 on one line (``benchmarks/bench_json_mode.py``). ``whitespace=False``
gives the compact form (``{"a":1}``).
"""

from __future__ import annotations

import copy
from typing import Any

MAX_BLANK_CHARS = 4
WHITESPACE_PATTERN = rf"[\x20\x09]{{0,{MAX_BLANK_CHARS}}}"

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = (
    "additionalProperties",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
)
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref")  # keys may come from here too


def guidance_options(whitespace: bool = True) -> dict[str, Any]:
    """llguidance's JSON options (its ``x-guidance`` object) for pagedkv's whitespace rule."""
    if not whitespace:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True, "whitespace_pattern": WHITESPACE_PATTERN}


def guidance_schema(
    schema: dict[str, Any] | bool, *, open_objects: bool = False, whitespace: bool = True
) -> dict[str, Any]:
    """``schema`` as llguidance compiles it under pagedkv's rules: objects closed (unless
    ``open_objects``), ``guidance_options`` in ``x-guidance`` (the schema's own ``x-guidance``
    keys win). A new object: ``schema`` is not modified."""
    if isinstance(schema, bool):  # true: any value; false: none (llguidance refuses it)
        schema = {} if schema else {"not": {}}
    out = copy.deepcopy(schema) if open_objects else close_objects(schema)
    out["x-guidance"] = {**guidance_options(whitespace), **schema.get("x-guidance", {})}
    return out


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` where every object schema with ``properties`` or
    ``patternProperties`` and no ``additionalProperties``/``unevaluatedProperties`` gets
    ``"additionalProperties": false``, except where its keys are composed (module docstring)."""
    return _close(schema, composed=False)


def _close(schema: Any, composed: bool) -> Any:
    """``composed``: ``schema`` is one part of an object whose keys come from several parts."""
    if not isinstance(schema, dict):
        return copy.deepcopy(schema)
    out = dict(schema)
    lists_keys = "properties" in schema or "patternProperties" in schema
    for key in _ONE:
        if key in schema:
            out[key] = _close(schema[key], composed=False)
    for key in _MANY:
        if isinstance(schema.get(key), list):
            # allOf's parts are always pieces of one object; anyOf/oneOf's are whole
            # alternatives unless properties beside them add keys to every alternative.
            part = key == "allOf" or (key in ("anyOf", "oneOf") and lists_keys)
            out[key] = [_close(s, composed=part) for s in schema[key]]
    for key in _NAMED:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _close(s, composed=False) for name, s in schema[key].items()}
    if (
        lists_keys
        and not composed
        and not any(k in schema for k in _COMPOSED)
        and "additionalProperties" not in schema
        and "unevaluatedProperties" not in schema
    ):
        out["additionalProperties"] = False
    return out
