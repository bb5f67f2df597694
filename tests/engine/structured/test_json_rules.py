"""pagedkv's JSON rules (``engine/structured/json_schema.py``) against an independent validator.

Which objects are closed is checked by ``jsonschema`` on instances, against schemas closed by
hand here; what the grammar lets a sample write is checked on samples drawn from random logits
under the engine's own masks (random logits reach tokens a trained model rarely picks), with
every blank-only token pushed up so that a sample loops on blanks wherever it may."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest
import torch

from pagedkv.engine.structured.grammar import GrammarCache, accept, apply_masks
from pagedkv.engine.structured.json_schema import MAX_BLANK_CHARS, close_objects, guidance_schema
from pagedkv.engine.structured.spec import StructuredOutput

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]}}, "required": ["city"]}  # fmt: skip
NESTED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
          "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
          "geo": {"type": "object", "properties": {"lat": {"type": "integer"}}}},
          "required": ["name", "geo"]}  # fmt: skip
PYDANTIC = {"$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
            "required": ["kind"]}}, "type": "object",
            "properties": {"pet": {"$ref": "#/$defs/Pet"}}, "required": ["pet"]}  # fmt: skip
# The same schemas closed by hand: what the rule must mean.
CITY_CLOSED = {**CITY, "additionalProperties": False}
NESTED_CLOSED = {
    **NESTED,
    "additionalProperties": False,
    "properties": {
        **NESTED["properties"],
        "geo": {**NESTED["properties"]["geo"], "additionalProperties": False},
    },
}
PYDANTIC_CLOSED = {**PYDANTIC, "additionalProperties": False, "$defs": {
    "Pet": {**PYDANTIC["$defs"]["Pet"], "additionalProperties": False}}}  # fmt: skip
MAX_SAMPLE_TOKENS = 200
SAMPLES = 12


def valid(instance, schema) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


@pytest.mark.parametrize(("schema", "by_hand"), [(CITY, CITY_CLOSED), (NESTED, NESTED_CLOSED),
                                                 (PYDANTIC, PYDANTIC_CLOSED)])  # fmt: skip
def test_unset_additional_properties_close_the_object(schema, by_hand):
    before = copy.deepcopy(schema)
    closed = close_objects(schema)
    assert closed == by_hand and schema == before  # a copy: the caller's schema is kept
    assert guidance_schema(schema, open_objects=True)["properties"] == schema["properties"]


def test_what_closing_leaves_alone():
    anything = {"type": "object"}  # no listed keys: JSON mode's schema stays any object
    assert valid({"x": 1}, close_objects(anything))
    told = {"type": "object", "properties": {"a": {}}, "additionalProperties": True}
    assert valid({"a": 1, "b": 2}, close_objects(told))
    parts = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert valid({"a": 1, "b": 2}, close_objects(parts))  # each part lists half the keys
    beside = {"properties": {"kind": {}}, "anyOf": [{"properties": {"x": {}}}]}
    assert valid({"kind": 1, "x": 2}, close_objects(beside))
    alternatives = {"anyOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]}
    closed = close_objects(alternatives)
    assert valid({"x": 1}, closed) and not valid({"x": 1, "z": 2}, closed)


@pytest.fixture(scope="module")
def grammars(embedded):
    config, _, tokenizer = embedded
    bias = blank_bias(tokenizer, config.vocab_size)
    return GrammarCache(tokenizer, config.vocab_size), tokenizer, config.vocab_size, bias


def blank_bias(tokenizer, vocab_size: int) -> torch.Tensor:
    """+6 on every token made only of blanks (space, tab, newline): a sample takes them
    wherever the grammar lets it."""
    bias = torch.zeros(vocab_size)
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i])
        if text and not text.strip():
            bias[i] = 6.0
    return bias


def draw(
    grammars,
    spec: StructuredOutput,
    seed: int,
    min_closed: int = SAMPLES * 3 // 4,
    n: int = SAMPLES,
) -> list[str]:
    """Texts of the ``n`` samples that closed their structure (cut ones left out); at least
    ``min_closed`` must (random keys of an open object are long, and few close)."""
    cache, tokenizer, vocab_size, bias = grammars
    gen = torch.Generator().manual_seed(seed)
    texts = []
    for matcher in cache.matchers(spec, n):
        ids = []
        for _ in range(MAX_SAMPLE_TOKENS):
            logits = torch.randn(1, vocab_size, generator=gen) + bias
            apply_masks(logits, [matcher])
            token = int(torch.multinomial(logits.softmax(-1)[0], 1, generator=gen))
            ids.append(token)
            if accept(matcher, token):
                texts.append(tokenizer.decode(ids))
                break
    assert len(texts) >= min_closed, f"{len(texts)} samples closed within the token cap"
    return texts


def blanks_between_tokens(text: str) -> list[str]:
    """The runs of blanks outside JSON strings."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return re.findall(r"\s+", outside)


@pytest.mark.parametrize(("schema", "by_hand"), [(CITY, CITY_CLOSED), (NESTED, NESTED_CLOSED),
                                                 (PYDANTIC, PYDANTIC_CLOSED)])  # fmt: skip
def test_sampled_json_validates_with_bounded_blanks_on_one_line(grammars, schema, by_hand):
    texts = draw(grammars, StructuredOutput.of_schema(schema, "s"), seed=len(json.dumps(schema)))
    for text in texts:
        assert valid(json.loads(text), by_hand), text
        for run in blanks_between_tokens(text):
            assert len(run) <= MAX_BLANK_CHARS and "\n" not in run and "\r" not in run, text
    assert any(blanks_between_tokens(t) for t in texts)  # blanks are allowed, only bounded


def test_json_mode_is_any_object_and_compact_has_no_blanks(grammars):
    for text in draw(grammars, StructuredOutput("json_object", param="s"), 1, 3):
        assert isinstance(json.loads(text), dict), text
        assert all(len(r) <= MAX_BLANK_CHARS for r in blanks_between_tokens(text)), text
    compact = StructuredOutput.of_schema(CITY, "s", whitespace=False)
    for text in draw(grammars, compact, seed=2):
        assert valid(json.loads(text), CITY_CLOSED) and not blanks_between_tokens(text), text


def test_open_objects_admit_unlisted_keys(grammars):
    """JSON Schema's default, on request: some random sample uses a key the schema lacks."""
    spec = StructuredOutput.of_schema(CITY, "s", open_objects=True)
    objects = [json.loads(t) for t in draw(grammars, spec, seed=3, min_closed=5, n=20)]
    assert all(valid(o, CITY) for o in objects)
    assert any(set(o) - {"city", "unit"} for o in objects)
