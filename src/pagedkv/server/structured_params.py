"""A request's output constraint, from whichever spelling the client used.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and vLLM's older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` all become one ``StructuredOutput`` whose
``param`` is the field the client sent, so an error names what the client wrote. Two
constraints in one request are a 400: which one would win is not a question to guess at.

The JSON rules (``engine/structured/json_schema.py``) take vLLM's two options from ``structured_outputs``
whatever spelling carries the constraint, tools' arguments included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.engine.structured.spec import StructuredOutput
from pagedkv.errors import UsageError
from pagedkv.server.errors import APIError, from_usage


@dataclass(frozen=True)
class JsonRules:
    """``open_objects``: JSON Schema's default for unset ``additionalProperties``;
    ``whitespace``: bounded blanks allowed (False: none)."""

    open_objects: bool = False
    whitespace: bool = True


def json_rules(req: Any) -> JsonRules:
    """The request's JSON rules (``structured_outputs.disable_*``; pagedkv's defaults)."""
    so = req.structured_outputs
    if so is None:
        return JsonRules()
    return JsonRules(
        open_objects=so.disable_additional_properties is False,
        whitespace=not so.disable_any_whitespace,
    )


def structured_output(req: Any) -> StructuredOutput | None:
    """The constraint of ``req`` (a completions or chat request), or None; ``APIError``."""
    found: list[tuple[str, str, Any]] = []  # (param, kind, value)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", "json_object", None))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(
                "response_format of type json_schema needs json_schema.schema",
                param="response_format.json_schema",
                code="invalid_value",
            )
        found.append(("response_format.json_schema.schema", "json", fmt.json_schema.schema_))
    so = req.structured_outputs
    if so is not None:
        for name, kind, value in (
            ("json", "json", so.json_),
            ("regex", "regex", so.regex),
            ("choice", "choice", so.choice),
            ("grammar", "grammar", so.grammar),
        ):
            if value is not None:
                found.append((f"structured_outputs.{name}", kind, value))
        if so.json_object:
            found.append(("structured_outputs.json_object", "json_object", None))
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            found.append((name, kind, value))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(n for n, _, _ in found)
        raise APIError(
            f"give one output constraint, not several ({names})",
            param=found[1][0],
            code="invalid_value",
        )
    param, kind, value = found[0]
    rules = json_rules(req)
    try:
        if kind == "json" and not isinstance(value, str):
            return StructuredOutput.of_schema(value, param, rules.open_objects, rules.whitespace)
        if kind == "choice":
            return StructuredOutput.of_choices(value, param)
        return StructuredOutput(kind, value or "", param, rules.open_objects, rules.whitespace)
    except UsageError as exc:
        raise from_usage(exc, {}) from None
