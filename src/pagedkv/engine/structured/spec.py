"""``StructuredOutput``: what a request's output must match, validated once at the edge.

Torch-free and library-free: the spec only names the constraint. ``engine/structured/grammar.py`` compiles
it (llguidance) into the token mask the sampler applies. Kinds, as vLLM's ``structured_outputs``
names them: ``json`` (a JSON Schema, as JSON text), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of a list of strings), ``grammar`` (Lark, or GBNF with ``::=`` rules), ``lark``
(Lark only: the server's own tool-call grammars).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagedkv.errors import UsageError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark")
MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar beyond this is a mistake, not a contract
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """``spec``: the schema's JSON text (``json``), the pattern (``regex``), the choices as a
    JSON list of strings (``choice``), the grammar text (``grammar``); ``""`` for
    ``json_object``. ``param`` is the request field errors name (the server's spelling).

    The JSON rules of ``engine/structured/json_schema.py`` (kinds ``json`` and ``json_object``):
    ``open_objects`` admits keys a schema does not list where it leaves
    ``additionalProperties`` unset (JSON Schema's default; pagedkv's is to refuse them);
    ``whitespace=False`` allows no blanks at all (``{"a":1}``). ``parts``: constraints the spec
    is built from, each compiled and probed alone first so an error names its own field (a
    forced call's grammar: each tool's parameter schema)."""

    kind: str
    spec: str = ""
    param: str = "structured_outputs"
    open_objects: bool = False
    whitespace: bool = True
    parts: tuple[StructuredOutput, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            self._refuse(f"has an unknown kind {self.kind!r} (one of {', '.join(KINDS)})")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            self._refuse(f"must be text of at most {MAX_SPEC_CHARS} characters")
        if self.kind in ("json", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError as exc:
                self._refuse(f"is not valid JSON: {exc}")
            if self.kind == "json" and not isinstance(value, (dict, bool)):
                self._refuse("must be a JSON Schema (an object)")
            if self.kind == "choice" and not (
                isinstance(value, list)
                and 0 < len(value) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in value)
            ):
                self._refuse(f"must list 1 to {MAX_CHOICES} non-empty strings")
        elif self.kind in ("regex", "grammar", "lark") and not self.spec:
            self._refuse("is empty")

    def _refuse(self, why: str) -> None:
        raise UsageError(f"{self.param} {why}", param=self.param)

    @classmethod
    def of_schema(
        cls, schema: object, param: str, open_objects: bool = False, whitespace: bool = True
    ) -> StructuredOutput:
        return cls("json", json.dumps(schema), param, open_objects, whitespace)

    @classmethod
    def of_choices(cls, choices: list[str], param: str) -> StructuredOutput:
        return cls("choice", json.dumps(choices), param)
